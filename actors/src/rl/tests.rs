use super::*;

fn fixtures() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures/rl")
}

fn load(name: &str) -> serde_json::Value {
    let p = fixtures().join(name);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| {
        panic!(
            "fixture {} missing ({e}): shared/ must sit beside the project",
            p.display()
        )
    });
    serde_json::from_str(&text).expect("fixture is JSON")
}

fn f64s(v: &serde_json::Value) -> Vec<f64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().expect("number"))
        .collect()
}

#[test]
fn advantages_match_the_numpy_fixtures() {
    let f = load("advantages.json");
    assert_eq!(f["epsilon"].as_f64(), Some(GRPO_EPS));
    let cases = f["cases"].as_array().expect("cases");
    assert!(!cases.is_empty());
    for c in cases {
        let r = f64s(&c["rewards"]);
        for (kind, key) in [
            (AdvantageKind::Grpo, "grpo"),
            (AdvantageKind::DrGrpo, "dr_grpo"),
            (AdvantageKind::Rloo, "rloo"),
        ] {
            let want = f64s(&c[key]);
            let got = advantages(kind, &r);
            assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g - w).abs() <= 1e-6,
                    "{key} for {r:?}: got {got:?}, want {want:?}"
                );
            }
        }
    }
}

fn parse_key(key: &str) -> PpoConfig {
    let mut cfg = PpoConfig::default();
    for part in key.split('/') {
        match part.split_once('=') {
            None if part == "token_mean" => cfg.aggregation = Aggregation::TokenMean,
            None if part == "seq_mean_token_mean" => {
                cfg.aggregation = Aggregation::SeqMeanTokenMean
            }
            Some(("eps_low", v)) => cfg.eps_low = v.parse().expect("eps_low"),
            Some(("eps_high", v)) => cfg.eps_high = v.parse().expect("eps_high"),
            Some(("tis_cap", v)) => cfg.tis_cap = Some(v.parse().expect("tis_cap")),
            _ => panic!("unknown fixture key part {part:?}"),
        }
    }
    cfg
}

#[test]
fn ppo_losses_match_the_numpy_fixtures() {
    let f = load("ppo_loss.json");
    let mut checked = 0;
    for c in f["cases"].as_array().expect("cases") {
        let rows = |k: &str| {
            c[k].as_array()
                .expect(k)
                .iter()
                .map(f64s)
                .collect::<Vec<_>>()
        };
        let (new, old, beh, mask) = (
            rows("logp_new"),
            rows("logp_old"),
            rows("logp_behaviour"),
            rows("mask"),
        );
        let adv = f64s(&c["advantages"]);
        let seqs: Vec<SeqLossInput<'_>> = (0..adv.len())
            .map(|i| SeqLossInput {
                logp_new: &new[i],
                logp_old: &old[i],
                logp_behaviour: &beh[i],
                mask: &mask[i],
                advantage: adv[i],
            })
            .collect();
        for (key, want) in c["expected"].as_object().expect("expected") {
            let got = ppo_loss(&parse_key(key), &seqs);
            let want = want.as_f64().expect("number");
            assert!((got - want).abs() <= 1e-6, "{key}: got {got}, want {want}");
            checked += 1;
        }
    }
    assert!(checked >= 8);
}

#[test]
fn on_policy_first_step_clipped_and_unclipped_coincide() {
    // ρ = 1 when new = old: the loss is −A on every action token.
    let lp = [-1.0, -2.0, -0.5];
    let mask = [1.0, 0.0, 1.0];
    let s = SeqLossInput {
        logp_new: &lp,
        logp_old: &lp,
        logp_behaviour: &lp,
        mask: &mask,
        advantage: 0.7,
    };
    let l = ppo_loss(&PpoConfig::default(), &[s]);
    assert!((l + 0.7).abs() < 1e-12);
}

#[test]
fn k3_is_zero_at_equality_and_positive_elsewhere() {
    assert_eq!(kl_k3(-1.0, -1.0), 0.0);
    assert!(kl_k3(-1.0, -2.0) > 0.0 && kl_k3(-2.0, -1.0) > 0.0);
}
