//! The behaviour contract, in numbered sections that the code, the tests and the contract suite
//! cite (`§5.3`, `§10.1`, ...): `docs/PROTOCOL.md` in the crate's sources, published here so that
//! its sections can be read, and linked, on docs.rs.
#![doc = include_str!("../docs/PROTOCOL.md")]

/// Reading `docs/PROTOCOL.md` and the README in tests, so that a table of values the code emits
/// (outcomes, problem kinds, metric labels) fails a test when it omits or adds one.
#[cfg(test)]
pub(crate) mod text {
    /// PROTOCOL.md.
    pub(crate) const PROTOCOL: &str = include_str!("../docs/PROTOCOL.md");
    /// The crate's README.
    pub(crate) const README: &str = include_str!("../README.md");

    /// The section of `doc` under the heading that starts with `heading` (`"### 6.5"`), up to the
    /// next heading of its level or above.
    pub(crate) fn section(doc: &'static str, heading: &str) -> &'static str {
        let level = heading.split(' ').next().unwrap_or_default();
        let start = doc
            .find(&format!("\n{heading}"))
            .unwrap_or_else(|| panic!("no heading {heading}"));
        let body = &doc[start + 1..];
        let end = body
            .match_indices('\n')
            .map(|(i, _)| i + 1)
            .find(|&i| {
                let hashes = body[i..].bytes().take_while(|&b| b == b'#').count();
                (1..=level.len()).contains(&hashes) && body[i + hashes..].starts_with(' ')
            })
            .unwrap_or(body.len());
        &body[..end]
    }

    /// The rows of the markdown tables in `text`, each as its trimmed cells; header separators
    /// left out.
    pub(crate) fn table_rows(text: &str) -> Vec<Vec<&str>> {
        text.lines()
            .filter(|line| line.starts_with('|') && !line.starts_with("|---"))
            .map(|line| line.trim_matches('|').split(" | ").map(str::trim).collect())
            .collect()
    }

    /// The code spans (`` `like this` ``) in `text`, in order.
    pub(crate) fn code_spans(text: &str) -> Vec<&str> {
        text.split('`').skip(1).step_by(2).collect()
    }

    /// The pairs written `` `Name` (`name`) `` in `text`.
    pub(crate) fn named_pairs(text: &str) -> std::collections::BTreeSet<(String, String)> {
        let parts: Vec<&str> = text.split('`').collect();
        (1..parts.len().saturating_sub(2))
            .step_by(2)
            .filter(|&i| parts[i + 1].trim() == "(")
            .map(|i| (parts[i].to_owned(), parts[i + 2].to_owned()))
            .collect()
    }

    /// The row among `rows` whose first cell is `` `name` ``.
    pub(crate) fn row<'a>(rows: &'a [Vec<&'a str>], name: &str) -> &'a [&'a str] {
        rows.iter()
            .find(|row| row[0] == format!("`{name}`"))
            .unwrap_or_else(|| panic!("no row for {name}"))
    }
}
