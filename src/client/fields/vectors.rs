//! The client's field parser against the HTTP working group's Structured Field test vectors
//! (httpwg/structured-field-tests), which `scripts/structured_field_tests.sh` downloads to
//! `target/structured-field-tests` (`scripts/test.sh` runs it first).
//!
//! Every vector of the List type, in every file, goes through [`list`] as the client reads a
//! `RateLimit` field: one that must fail is ignored whole, and one that parses gives the
//! policies its expected value names (its String and Token members, with their `r`, `t`, `q`
//! and `w` where those are non-negative Integers; the first 16). Every vector of the Item type
//! (the numbers, strings, tokens, byte sequences, Booleans, dates and display strings) goes
//! through it too, as the one member of a List: one that parses is a List of that member; one
//! that must fail is ignored, unless its text is a valid List of another shape (see
//! [`a_list_otherwise`]). Dictionaries are not a shape of these fields: their vectors are not run.

use std::path::PathBuf;

use serde_json::Value;

use super::{MAX_POLICIES, Numbers, Policies, list};

/// The files of the vectors that hold Lists and Items, each of which must be there.
const FILES: [&str; 18] = [
    "binary.json",
    "boolean.json",
    "date.json",
    "display-string.json",
    "examples.json",
    "item.json",
    "key-generated.json",
    "large-generated.json",
    "list.json",
    "listlist.json",
    "number-generated.json",
    "number.json",
    "param-list.json",
    "param-listlist.json",
    "string-generated.json",
    "string.json",
    "token-generated.json",
    "token.json",
];

fn vectors_dir() -> PathBuf {
    std::env::var_os("TOLLGATE_STRUCTURED_FIELD_TESTS").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/structured-field-tests"),
        PathBuf::from,
    )
}

/// What the client reads of an expected List: its String and Token members, with their numbers.
fn expected_policies(members: &[Value]) -> Vec<(String, Numbers)> {
    let mut policies = Vec::new();
    for member in members {
        let [bare, parameters] = member.as_array().expect("a member").as_slice() else {
            panic!("a member is a value and its parameters: {member}");
        };
        let name = match bare {
            Value::String(text) => text.clone(),
            Value::Object(typed) if typed["__type"] == "token" => {
                typed["value"].as_str().expect("a token").to_owned()
            }
            _ => continue,
        };
        let mut numbers = Numbers::default();
        for parameter in parameters.as_array().expect("parameters") {
            let (key, value) = (parameter[0].as_str().expect("a key"), &parameter[1]);
            // A JSON integer is an Integer; 1.0 is a Decimal.
            let number = value.as_u64();
            match key {
                "r" => numbers.r = number,
                "t" => numbers.t = number,
                "q" => numbers.q = number,
                "w" => numbers.w = number,
                _ => {}
            }
        }
        policies.push((name, numbers));
    }
    policies.truncate(MAX_POLICIES);
    policies
}

fn read(policies: &Policies<'_>) -> Vec<(String, Numbers)> {
    policies
        .iter()
        .map(|p| (p.name.clone().into_owned(), p.numbers))
        .collect()
}

/// Whether an Item vector's text that must fail as an Item may still be a valid List: empty,
/// with a comma or an inner list outside strings, or followed by a tab (a List's members may be
/// followed by tabs and spaces, an Item by spaces only). The client's fields are Lists, so its
/// failing as an Item says nothing of them.
fn a_list_otherwise(raw: &str) -> bool {
    let trimmed = raw.trim_matches(' ');
    let after = &raw[raw.trim_end_matches([' ', '\t']).len()..];
    trimmed.is_empty() || trimmed.starts_with('(') || after.contains('\t') || {
        let mut quoted = false;
        let mut escaped = false;
        raw.chars().any(|c| {
            match c {
                _ if escaped => escaped = false,
                '\\' if quoted => escaped = true,
                '"' => quoted = !quoted,
                ',' if !quoted => return true,
                _ => {}
            }
            false
        })
    }
}

#[test]
fn the_structured_field_test_vectors_of_lists_and_items() {
    let dir = vectors_dir();
    let mut lists = 0;
    let mut items = 0;
    // Item vectors that must fail, not run: valid Lists of another shape.
    let mut lists_otherwise = 0;
    let mut failures = Vec::new();
    for file in FILES {
        let path = dir.join(file);
        let text = std::fs::read_to_string(&path).unwrap_or_else(|error| {
            panic!(
                "the Structured Field test vectors are not at {} ({error}): run \
                 ./scripts/structured_field_tests.sh (scripts/test.sh runs it), or set \
                 TOLLGATE_STRUCTURED_FIELD_TESTS to a copy of httpwg/structured-field-tests",
                path.display()
            )
        });
        let vectors: Vec<Value> = serde_json::from_str(&text).expect("a JSON array of vectors");
        for vector in &vectors {
            let name = vector["name"].as_str().expect("a name");
            let raw: Vec<&str> = vector["raw"]
                .as_array()
                .expect("raw lines")
                .iter()
                .map(|line| line.as_str().expect("a line"))
                .collect();
            let must_fail = vector["must_fail"].as_bool().unwrap_or(false);
            let can_fail = vector["can_fail"].as_bool().unwrap_or(false);
            let parsed = list(raw.iter().map(|line| line.as_bytes()));
            let expected = match vector["header_type"].as_str() {
                Some("list") => {
                    lists += 1;
                    (!must_fail).then(|| expected_policies(vector["expected"].as_array().unwrap()))
                }
                Some("item") => {
                    items += 1;
                    if must_fail && a_list_otherwise(&raw.join(", ")) {
                        lists_otherwise += 1;
                        continue;
                    }
                    (!must_fail).then(|| expected_policies(&[vector["expected"].clone()]))
                }
                _ => continue,
            };
            let fine = match (&parsed, &expected) {
                (None, None) => true,
                (None, Some(_)) => can_fail,
                (Some(_), None) => false,
                (Some(parsed), Some(expected)) => read(parsed) == *expected,
            };
            if !fine {
                failures.push(format!(
                    "{file}: {name}: {raw:?}: read {:?}, expected {:?}",
                    parsed.as_ref().map(read),
                    expected
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} vectors not read as RFC 9651 says:\n{}",
        failures.len(),
        failures.join("\n")
    );
    // Every file read, whole: the counts of the copy scripts/structured_field_tests.sh pins.
    assert_eq!(
        (lists, items, lists_otherwise),
        (306, 812, 6),
        "List and Item vectors, and Item vectors that are valid Lists"
    );
}
