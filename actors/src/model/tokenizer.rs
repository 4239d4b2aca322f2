//! The built-in policy's tokenizer: byte-level. Ids 0–255 are the bytes of the UTF-8 text;
//! four special tokens follow. Every text the built-in environments produce round-trips
//! exactly; token ids flow end to end (nothing is re-tokenised between turns).

/// Beginning of a sequence.
pub const BOS: u32 = 256;
/// End of the policy's turn: generation stops on it.
pub const EOT: u32 = 257;
/// Padding in training batches (never attended to, never trained on).
pub const PAD: u32 = 258;
/// Separates an observation from the policy's answer.
pub const SEP: u32 = 259;
/// Vocabulary size.
pub const VOCAB: usize = 260;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    pub fn encode(&self, text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }

    /// Decodes bytes, skipping special tokens; invalid UTF-8 is replaced (lossy).
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids.iter().filter(|&&i| i < 256).map(|&i| i as u8).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    pub fn is_special(id: u32) -> bool {
        (256..VOCAB as u32).contains(&id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_text_round_trips() {
        let t = ByteTokenizer;
        for s in [
            "",
            "S F F F\nF H F H\n",
            "up down left right",
            "3 + 4 = 7",
            "\\boxed{42}",
            "x o x\n. . o",
            "héllo ✓",
        ] {
            assert_eq!(t.decode(&t.encode(s)), s);
            assert!(t.encode(s).iter().all(|&i| i < 256));
        }
    }

    #[test]
    fn specials_are_skipped_when_decoding() {
        let t = ByteTokenizer;
        let mut ids = vec![BOS];
        ids.extend(t.encode("ok"));
        ids.extend([SEP, EOT, PAD]);
        assert_eq!(t.decode(&ids), "ok");
        assert!(ByteTokenizer::is_special(EOT) && !ByteTokenizer::is_special(65));
    }
}
