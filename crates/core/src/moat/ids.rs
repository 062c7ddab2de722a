//! Sandbox and task ids.

/// `sbx-` and 8 random hex digits.
pub(super) fn new_id() -> String {
    let mut bytes = [0u8; 4];
    if getrandom::fill(&mut bytes).is_err() {
        // No entropy source: ids need only differ, not be secret.
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        bytes = (nanos ^ std::process::id()).to_le_bytes();
    }
    format!("sbx-{}", bytes.iter().map(|b| format!("{b:02x}")).collect::<String>())
}

#[cfg(test)]
mod tests {
    use super::new_id;

    #[test]
    fn ids_are_sbx_and_eight_hex_digits_and_differ() {
        let (a, b) = (new_id(), new_id());
        for id in [&a, &b] {
            let digits = id.strip_prefix("sbx-").unwrap_or_default();
            assert_eq!(digits.len(), 8, "{id}");
            assert!(digits.bytes().all(|c| c.is_ascii_hexdigit()), "{id}");
        }
        assert_ne!(a, b);
    }
}
