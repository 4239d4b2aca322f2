//! Seeded distributions for latencies and lengths in simulators.

use rand::Rng;
use rand_distr::{Distribution, LogNormal, Normal};
use serde::{Deserialize, Serialize};

/// A distribution of a non-negative quantity (seconds or tokens). Part of the job spec, so it
/// is (de)serialisable: `{ constant = 1.0 }`, `{ normal = { mean = 10, std = 5 } }`,
/// `{ lognormal = { mu = 0.0, sigma = 1.0 } }`, `{ uniform = { low = 1, high = 4 } }`,
/// `{ quantiles = [[0.0, 1.0], [0.5, 2.0], [1.0, 30.0]] }` (piecewise-linear inverse CDF).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Dist {
    Constant(f64),
    Normal { mean: f64, std: f64 },
    Lognormal { mu: f64, sigma: f64 },
    Uniform { low: f64, high: f64 },
    Quantiles(Vec<(f64, f64)>),
}

impl Default for Dist {
    fn default() -> Self {
        Self::Constant(0.0)
    }
}

impl Dist {
    /// Draws one value, clamped at zero.
    pub fn sample<R: Rng + ?Sized>(&self, rng: &mut R) -> f64 {
        let v = match self {
            Self::Constant(c) => *c,
            Self::Normal { mean, std } => match Normal::new(*mean, *std) {
                Ok(n) => n.sample(rng),
                Err(_) => *mean,
            },
            Self::Lognormal { mu, sigma } => match LogNormal::new(*mu, *sigma) {
                Ok(n) => n.sample(rng),
                Err(_) => mu.exp(),
            },
            Self::Uniform { low, high } => {
                if high > low {
                    rng.random_range(*low..*high)
                } else {
                    *low
                }
            }
            Self::Quantiles(points) => {
                let u: f64 = rng.random();
                inverse_cdf(points, u)
            }
        };
        if v.is_finite() { v.max(0.0) } else { 0.0 }
    }

    /// The mean (exact for the parametric forms, numeric for quantiles).
    pub fn mean(&self) -> f64 {
        match self {
            Self::Constant(c) => *c,
            Self::Normal { mean, .. } => *mean,
            Self::Lognormal { mu, sigma } => (mu + sigma * sigma / 2.0).exp(),
            Self::Uniform { low, high } => (low + high) / 2.0,
            Self::Quantiles(points) => {
                let n = 1000;
                (0..n)
                    .map(|i| inverse_cdf(points, (i as f64 + 0.5) / n as f64))
                    .sum::<f64>()
                    / n as f64
            }
        }
    }

    /// E[max(X, floor)²], from 4,096 draws of a fixed-seed generator (deterministic).
    pub fn mean_square_at_least(&self, floor: f64) -> f64 {
        use rand::SeedableRng;
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
        let n = 4096;
        (0..n)
            .map(|_| {
                let x = self.sample(&mut rng).max(floor);
                x * x
            })
            .sum::<f64>()
            / f64::from(n)
    }

    /// A value the distribution rarely exceeds: the largest value it can take, or six
    /// standard deviations (in log space for a lognormal) above the centre.
    pub fn upper(&self) -> f64 {
        match self {
            Self::Constant(c) => *c,
            Self::Normal { mean, std } => mean + 6.0 * std,
            Self::Lognormal { mu, sigma } => (mu + 6.0 * sigma).exp(),
            Self::Uniform { high, .. } => *high,
            Self::Quantiles(points) => points.iter().map(|p| p.1).fold(0.0, f64::max),
        }
    }

    /// Problems with the parameters, as messages; empty when valid.
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        let finite = |x: f64| x.is_finite();
        match self {
            Self::Constant(c) if !finite(*c) || *c < 0.0 => out.push(format!(
                "constant must be a finite non-negative number, got {c}"
            )),
            Self::Normal { mean, std } if !finite(*mean) || !finite(*std) || *std < 0.0 => out
                .push(format!(
                    "normal needs finite mean and std >= 0, got mean={mean} std={std}"
                )),
            Self::Lognormal { mu, sigma } if !finite(*mu) || !finite(*sigma) || *sigma < 0.0 => out
                .push(format!(
                    "lognormal needs finite mu and sigma >= 0, got mu={mu} sigma={sigma}"
                )),
            Self::Uniform { low, high } if !finite(*low) || !finite(*high) || high < low => out
                .push(format!(
                    "uniform needs low <= high, got low={low} high={high}"
                )),
            Self::Quantiles(points) => {
                if points.len() < 2 {
                    out.push("quantiles needs at least two [p, value] points".into());
                }
                if points.first().is_some_and(|p| p.0 != 0.0)
                    || points.last().is_some_and(|p| p.0 != 1.0)
                {
                    out.push("quantiles must start at p=0 and end at p=1".into());
                }
                if points
                    .windows(2)
                    .any(|w| w[1].0 <= w[0].0 || w[1].1 < w[0].1)
                {
                    out.push(
                        "quantiles must be strictly increasing in p and non-decreasing in value"
                            .into(),
                    );
                }
            }
            _ => {}
        }
        out
    }
}

fn inverse_cdf(points: &[(f64, f64)], u: f64) -> f64 {
    let Some(first) = points.first() else {
        return 0.0;
    };
    if u <= first.0 {
        return first.1;
    }
    for w in points.windows(2) {
        let (p0, v0) = w[0];
        let (p1, v1) = w[1];
        if u <= p1 {
            let t = if p1 > p0 { (u - p0) / (p1 - p0) } else { 0.0 };
            return v0 + t * (v1 - v0);
        }
    }
    points.last().map_or(0.0, |p| p.1)
}

/// Longest modelled duration: 30 days (a spec's bound on every duration field).
pub const MAX_MODELLED_S: f64 = 30.0 * 24.0 * 3600.0;

/// A modelled duration in seconds as a clock duration: NaN and negatives are zero, and a
/// sample from a heavy tail (or a product of bounded fields) saturates at
/// [`MAX_MODELLED_S`] instead of overflowing the clock.
pub fn seconds(s: f64) -> std::time::Duration {
    if s.is_nan() || s <= 0.0 {
        return std::time::Duration::ZERO;
    }
    std::time::Duration::from_secs_f64(s.min(MAX_MODELLED_S))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::SmallRng;

    #[test]
    fn sample_means_are_close_to_analytic_means() {
        let cases = [
            Dist::Constant(2.0),
            Dist::Normal {
                mean: 10.0,
                std: 1.0,
            },
            Dist::Lognormal {
                mu: 0.0,
                sigma: 0.5,
            },
            Dist::Uniform {
                low: 1.0,
                high: 3.0,
            },
            Dist::Quantiles(vec![(0.0, 0.0), (0.5, 1.0), (1.0, 3.0)]),
        ];
        for d in cases {
            let mut rng = SmallRng::seed_from_u64(1);
            let n = 20_000;
            let m = (0..n).map(|_| d.sample(&mut rng)).sum::<f64>() / n as f64;
            assert!(
                (m - d.mean()).abs() < 0.05 * d.mean().max(1.0),
                "{d:?}: {m} vs {}",
                d.mean()
            );
        }
    }

    #[test]
    fn invalid_parameters_are_reported() {
        assert!(
            Dist::Normal {
                mean: 1.0,
                std: -1.0
            }
            .problems()
            .len()
                == 1
        );
        assert!(
            Dist::Quantiles(vec![(0.0, 2.0), (1.0, 1.0)])
                .problems()
                .len()
                == 1
        );
        assert!(
            Dist::Uniform {
                low: 1.0,
                high: 2.0
            }
            .problems()
            .is_empty()
        );
    }
}
