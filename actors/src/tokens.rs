//! Token sequences that may be *drawn*: a simulator's tokens and log-probabilities are values
//! nothing in a simulated run looks at, only their count. A drawn sequence holds the streams it
//! was drawn from (a seed and a length each, a handful per answer) instead of the values; the
//! values are computed, once, when something reads them (a stored trajectory, a test), and are
//! exactly those the simulator would have written out. Real engines' sequences hold their ids.
//!
//! [`Seq`] reads as a slice (`Deref`), so code that indexes or iterates works on either kind;
//! `len`, `is_empty`, `extend_from` and `truncate` never compute a drawn sequence's values.

use std::fmt;
use std::ops::Deref;
use std::sync::OnceLock;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// One stream of drawn values: `len` steps of the xorshift generator from `seed` (odd); step
/// `x` gives the token `1 + x % modulus` and the log-probability `-(x >> 40) · 3 / 2^24`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Draw {
    pub seed: u64,
    pub len: u32,
    pub modulus: u32,
}

impl Draw {
    /// The generator's states, one per value.
    fn states(self) -> impl Iterator<Item = u64> {
        let mut x = self.seed;
        (0..self.len).map(move |_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        })
    }
}

/// What a sequence holds: token ids or log-probabilities.
pub trait Element: Copy + fmt::Debug + PartialEq + Send + Sync + 'static {
    /// The value a generator state `x` stands for.
    fn drawn(x: u64, modulus: u32) -> Self;
}

impl Element for u32 {
    fn drawn(x: u64, modulus: u32) -> Self {
        1 + (x % u64::from(modulus.max(1))) as u32
    }
}

impl Element for f32 {
    fn drawn(x: u64, _modulus: u32) -> Self {
        -((x >> 40) as f32) * (3.0 / (1u64 << 24) as f32)
    }
}

/// A draw as a sequence keeps it: where it ends (the count of values up to and including
/// it) instead of its length, so the sequence's length is the last stream's end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stream {
    seed: u64,
    end: u32,
    modulus: u32,
}

#[derive(Clone)]
enum Repr<T> {
    Values(Vec<T>),
    /// (No length field: the last stream's end. A turn holds three sequences, and every
    /// in-flight and batched trajectory its turns: 48 bytes a sequence, not 64.)
    Drawn {
        draws: Vec<Stream>,
        /// The values, once read.
        values: OnceLock<Box<[T]>>,
    },
}

/// A sequence of token ids ([`Tokens`]) or log-probabilities ([`Logprobs`]), held as values or
/// as the draws that give them.
#[derive(Clone)]
pub struct Seq<T: Element>(Repr<T>);

/// Token ids.
pub type Tokens = Seq<u32>;
/// Log-probabilities, one per token.
pub type Logprobs = Seq<f32>;

impl<T: Element> Default for Seq<T> {
    fn default() -> Self {
        Self(Repr::Values(Vec::new()))
    }
}

impl<T: Element> Seq<T> {
    pub fn new() -> Self {
        Self::default()
    }

    /// The values of `draw`, not computed until read.
    pub fn drawn(draw: Draw) -> Self {
        let mut s = Self::default();
        s.push_draw(draw);
        s
    }

    pub fn len(&self) -> usize {
        match &self.0 {
            Repr::Values(v) => v.len(),
            Repr::Drawn { draws, .. } => drawn_len(draws),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the values are drawn (a simulator's), not held.
    pub fn is_drawn(&self) -> bool {
        matches!(self.0, Repr::Drawn { .. })
    }

    /// Gives back the room reserved beyond the length (a finished answer grows no more).
    pub fn shrink_to_fit(&mut self) {
        match &mut self.0 {
            Repr::Values(v) => v.shrink_to_fit(),
            Repr::Drawn { draws, .. } => draws.shrink_to_fit(),
        }
    }

    /// Appends the values of `draw`. An empty or drawn sequence stays drawn; one holding values
    /// gets the drawn values written out.
    pub fn push_draw(&mut self, draw: Draw) {
        if draw.len == 0 {
            return;
        }
        match &mut self.0 {
            Repr::Values(v) if v.is_empty() => {
                // Room for one stream: most answers are drawn in one fused step, and every
                // in-flight answer carries this room (8 streams was 0.25 KiB per trajectory).
                let draws = vec![Stream {
                    seed: draw.seed,
                    end: draw.len,
                    modulus: draw.modulus,
                }];
                self.0 = Repr::Drawn {
                    draws,
                    values: OnceLock::new(),
                };
            }
            Repr::Values(v) => v.extend(draw.states().map(|x| T::drawn(x, draw.modulus))),
            Repr::Drawn { draws, values } => {
                draws.push(Stream {
                    seed: draw.seed,
                    end: (drawn_len(draws) as u32).saturating_add(draw.len),
                    modulus: draw.modulus,
                });
                values.take();
            }
        }
    }

    /// Appends one value (a drawn sequence is written out first).
    pub fn push(&mut self, value: T) {
        self.values_mut().push(value);
    }

    /// Appends `other`: its draws when both are drawn (nothing computed), else its values.
    pub fn extend_from(&mut self, other: &Self) {
        if let Repr::Drawn { draws, .. } = &other.0
            && (self.is_drawn() || self.is_empty())
        {
            for d in draws_of(draws) {
                self.push_draw(d);
            }
            return;
        }
        self.values_mut().extend_from_slice(other);
    }

    /// Keeps the first `n` values.
    pub fn truncate(&mut self, n: usize) {
        match &mut self.0 {
            Repr::Values(v) => v.truncate(n),
            Repr::Drawn { draws, values } => {
                if n >= drawn_len(draws) {
                    return;
                }
                values.take();
                // The first stream that reaches `n` ends there; none after it is kept.
                match draws.iter().position(|d| d.end as usize >= n) {
                    Some(i) if n > 0 => {
                        draws.truncate(i + 1);
                        draws[i].end = n as u32;
                    }
                    _ => draws.clear(),
                }
            }
        }
    }

    pub fn clear(&mut self) {
        self.0 = Repr::Values(Vec::new());
    }

    /// The values, owned (a drawn sequence computes them).
    pub fn into_vec(self) -> Vec<T> {
        match self.0 {
            Repr::Values(v) => v,
            Repr::Drawn { draws, values } => values
                .into_inner()
                .map_or_else(|| compute(&draws), Vec::from),
        }
    }

    /// The values to change in place (a drawn sequence becomes one holding its values).
    fn values_mut(&mut self) -> &mut Vec<T> {
        if let Repr::Drawn { draws, values, .. } = &mut self.0 {
            let v = values.take().map_or_else(|| compute(draws), Vec::from);
            self.0 = Repr::Values(v);
        }
        match &mut self.0 {
            Repr::Values(v) => v,
            Repr::Drawn { .. } => unreachable!("written out above"),
        }
    }
}

fn drawn_len(draws: &[Stream]) -> usize {
    draws.last().map_or(0, |d| d.end as usize)
}

/// The draws the streams stand for (each stream's length is its end less the one before).
fn draws_of(streams: &[Stream]) -> impl Iterator<Item = Draw> + '_ {
    let mut start = 0;
    streams.iter().map(move |s| {
        let d = Draw {
            seed: s.seed,
            len: s.end - start,
            modulus: s.modulus,
        };
        start = s.end;
        d
    })
}

fn compute<T: Element>(draws: &[Stream]) -> Vec<T> {
    let mut v = Vec::with_capacity(drawn_len(draws));
    for d in draws_of(draws) {
        v.extend(d.states().map(|x| T::drawn(x, d.modulus)));
    }
    v
}

impl<T: Element> Deref for Seq<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match &self.0 {
            Repr::Values(v) => v,
            Repr::Drawn { draws, values } => {
                values.get_or_init(|| compute(draws).into_boxed_slice())
            }
        }
    }
}

impl<'a, T: Element> IntoIterator for &'a Seq<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl<T: Element> From<Vec<T>> for Seq<T> {
    fn from(v: Vec<T>) -> Self {
        Self(Repr::Values(v))
    }
}

impl<T: Element> From<&[T]> for Seq<T> {
    fn from(v: &[T]) -> Self {
        Self(Repr::Values(v.to_vec()))
    }
}

impl<T: Element> FromIterator<T> for Seq<T> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Self {
        Self(Repr::Values(iter.into_iter().collect()))
    }
}

impl<T: Element> PartialEq for Seq<T> {
    fn eq(&self, other: &Self) -> bool {
        match (&self.0, &other.0) {
            (Repr::Drawn { draws: a, .. }, Repr::Drawn { draws: b, .. }) if a == b => true,
            _ => self.len() == other.len() && **self == **other,
        }
    }
}

impl<T: Element> PartialEq<Vec<T>> for Seq<T> {
    fn eq(&self, other: &Vec<T>) -> bool {
        **self == **other
    }
}

impl<T: Element> PartialEq<[T]> for Seq<T> {
    fn eq(&self, other: &[T]) -> bool {
        **self == *other
    }
}

impl<T: Element> fmt::Debug for Seq<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Repr::Values(v) => v.fmt(f),
            Repr::Drawn { draws, .. } => {
                write!(f, "<{} drawn in {} streams>", drawn_len(draws), draws.len())
            }
        }
    }
}

/// Written as the plain array of values (a drawn sequence's computed), so a record reads the
/// same whichever kind made it.
impl<T: Element + Serialize> Serialize for Seq<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match &self.0 {
            Repr::Values(v) => v.serialize(s),
            Repr::Drawn { draws, values } => match values.get() {
                Some(v) => v.serialize(s),
                None => compute::<T>(draws).serialize(s),
            },
        }
    }
}

impl<'de, T: Element + Deserialize<'de>> Deserialize<'de> for Seq<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Vec::<T>::deserialize(d).map(Self::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The values the simulator wrote out before sequences were drawn.
    fn written(seed: u64, n: u32, modulus: u32) -> (Vec<u32>, Vec<f32>) {
        let mut x = seed;
        let (mut t, mut l) = (Vec::new(), Vec::new());
        for _ in 0..n {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            t.push(1 + (x % u64::from(modulus)) as u32);
            l.push(-((x >> 40) as f32) * (3.0 / (1u64 << 24) as f32));
        }
        (t, l)
    }

    /// A turn holds three sequences, and every in-flight and batched trajectory holds its
    /// turns: their size is memory per trajectory (issue #36's bound).
    #[test]
    fn sequences_and_turns_stay_small() {
        assert_eq!(std::mem::size_of::<Tokens>(), 48);
        assert_eq!(std::mem::size_of::<Logprobs>(), 48);
        assert!(std::mem::size_of::<crate::types::Turn>() <= 208);
    }

    #[test]
    fn drawn_sequences_read_as_the_values_they_stand_for() {
        let (a, b) = (
            Draw {
                seed: 0x9e37_79b9_7f4a_7c15,
                len: 5,
                modulus: 31_999,
            },
            Draw {
                seed: 77,
                len: 3,
                modulus: 100,
            },
        );
        let mut t = Tokens::drawn(a);
        let mut l = Logprobs::drawn(a);
        t.push_draw(b);
        l.push_draw(b);
        let (ta, la) = written(a.seed, 5, 31_999);
        let (tb, lb) = written(b.seed, 3, 100);
        assert_eq!(t.len(), 8);
        assert!(t.is_drawn());
        assert_eq!(*t, [ta.clone(), tb.clone()].concat());
        assert_eq!(*l, [la.clone(), lb].concat());
        assert_eq!(
            serde_json::to_value(&t).unwrap(),
            serde_json::json!([ta.clone(), tb.clone()].concat())
        );
        // Appending drawn to drawn keeps it drawn; truncating cuts a stream's length.
        let mut ctx = Tokens::new();
        ctx.extend_from(&t);
        assert!(ctx.is_drawn() && ctx.len() == 8);
        ctx.truncate(4);
        assert_eq!(*ctx, ta[..4]);
        // Cutting inside a later stream, then drawing more: each stream keeps its share.
        let mut cut = t.clone();
        cut.truncate(6);
        assert_eq!(cut.len(), 6);
        cut.push_draw(a);
        assert_eq!(cut.len(), 11);
        assert_eq!(*cut, [ta.clone(), tb[..1].to_vec(), ta.clone()].concat());
        cut.truncate(0);
        assert!(cut.is_empty());
        // Mixing with held values writes the drawn ones out.
        let mut held = Tokens::from(vec![9, 9]);
        held.extend_from(&t);
        assert!(!held.is_drawn());
        assert_eq!(held[..2], [9, 9]);
        assert_eq!(held[2..], *t);
        let mut t2 = t.clone();
        t2.push(5);
        assert_eq!(t2.len(), 9);
        assert_eq!(t2[8], 5);
        assert_eq!(t2[..8], *t);
        let back: Tokens = serde_json::from_str("[1,2,3]").unwrap();
        assert_eq!(back, vec![1, 2, 3]);
    }
}
