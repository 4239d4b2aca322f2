//! Secrets: random tokens for API access and agent episodes, from the system's CSPRNG (ring).

/// The system's random number generator failed.
pub type RandomError = ring::error::Unspecified;

/// A fresh token: `prefix` and 32 random bytes in lowercase hex.
pub fn new_token(prefix: &str) -> Result<String, RandomError> {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 32];
    ring::rand::SystemRandom::new().fill(&mut bytes)?;
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("{prefix}{hex}"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn tokens_are_prefixed_hex_and_differ() {
        let (a, b) = (
            super::new_token("rk_").unwrap(),
            super::new_token("rk_").unwrap(),
        );
        assert!(
            a.starts_with("rk_")
                && a.len() == 3 + 64
                && a[3..].bytes().all(|c| c.is_ascii_hexdigit())
        );
        assert_ne!(a, b);
    }
}
