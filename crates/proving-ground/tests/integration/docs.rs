//! The repository's documents against the repository: every relative link in every Markdown file
//! reaches a file that exists (and, with `#anchor`, a heading of it), and the library code the
//! README shows is the example's code as it stands, which the example's own tests compile and run.

use std::collections::HashMap;
use std::fs;
use std::path::{Component, Path, PathBuf};

/// The workspace root: two levels above this crate.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every `*.md` under `dir`, build output, VCS data and hidden directories left out.
fn markdown_files(dir: &Path, found: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() {
            if !(name.starts_with('.') || name == "target" || name == "node_modules") {
                markdown_files(&path, found);
            }
        } else if name.ends_with(".md") {
            found.push(path);
        }
    }
}

/// The lines of `text` outside fenced code blocks, with their line numbers (from 1).
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut lines = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            fenced = !fenced;
        } else if !fenced {
            lines.push((n + 1, line));
        }
    }
    lines
}

/// `line` without its inline code spans (a link inside backticks is text, not a link).
fn without_code_spans(line: &str) -> String {
    let mut out = String::new();
    let mut rest = line;
    while let Some(start) = rest.find('`') {
        out.push_str(&rest[..start]);
        let ticks = rest[start..].chars().take_while(|&c| c == '`').count();
        let fence = &rest[start..start + ticks];
        match rest[start + ticks..].find(fence) {
            Some(end) => rest = &rest[start + ticks + end + ticks..],
            None => {
                rest = &rest[start + ticks..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// The destinations of the inline links (`[text](dest)`) and reference definitions
/// (`[name]: dest`) of one line.
fn link_destinations(line: &str) -> Vec<String> {
    let line = without_code_spans(line);
    let mut found = Vec::new();
    let trimmed = line.trim_start();
    if trimmed.starts_with('[') {
        if let Some(close) = trimmed.find("]:") {
            let dest = trimmed[close + 2..].split_whitespace().next();
            found.extend(dest.map(str::to_owned));
        }
    }
    let mut rest = line.as_str();
    while let Some(at) = rest.find("](") {
        let tail = &rest[at + 2..];
        let dest: String = tail
            .trim_start_matches('<')
            .chars()
            .take_while(|&c| c != ')' && c != '>' && !c.is_whitespace())
            .collect();
        found.push(dest);
        rest = tail;
    }
    found
}

/// The anchor GitHub gives a heading: its text as rendered (link targets and code marks gone),
/// lower-cased, punctuation dropped but for `-` and `_`, spaces made hyphens.
fn slug(heading: &str) -> String {
    let mut text = String::new();
    let mut rest = heading;
    // `[text](dest)` renders as `text`.
    while let Some(open) = rest.find("](") {
        text.push_str(&rest[..open]);
        let after = &rest[open + 2..];
        rest = after.find(')').map_or("", |close| &after[close + 1..]);
    }
    text.push_str(rest);
    text.trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            '-' | '_' => Some(c),
            c if c.is_alphanumeric() => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a Markdown text: its headings', a repeated one suffixed `-1`, `-2`, … as GitHub
/// does, and those of `<a id="…">` / `<a name="…">` elements.
fn anchors(text: &str) -> Vec<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut found = Vec::new();
    for (_, line) in prose_lines(text) {
        for attribute in ["<a id=\"", "<a name=\""] {
            for (at, _) in line.match_indices(attribute) {
                let value = &line[at + attribute.len()..];
                found.extend(value.split('"').next().map(str::to_owned));
            }
        }
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if (1..=6).contains(&hashes) && line[hashes..].starts_with(' ') {
            let base = slug(&line[hashes..]);
            let count = seen.entry(base.clone()).or_insert(0);
            found.push(match *count {
                0 => base.clone(),
                n => format!("{base}-{n}"),
            });
            *count += 1;
        }
    }
    found
}

/// `path` with `.` and `..` resolved lexically.
fn normalise(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// Every relative link of the Markdown files under `root` that reaches no file, or no heading
/// of the file it names, as "file:line: link (why)".
fn broken_links(root: &Path) -> Vec<String> {
    let mut files = Vec::new();
    markdown_files(root, &mut files);
    let mut broken = Vec::new();
    for file in &files {
        let text = fs::read_to_string(file).expect("a Markdown file in UTF-8");
        let shown = file
            .strip_prefix(root)
            .unwrap_or(file)
            .display()
            .to_string();
        for (n, line) in prose_lines(&text) {
            for dest in link_destinations(line) {
                if dest.is_empty() || dest.contains("://") || dest.starts_with("mailto:") {
                    continue;
                }
                // A rustdoc intra-doc link (`crate::Store::run`) in a crate's Markdown that
                // rustdoc includes: the doc build (`cargo doc` with `-D warnings`) checks it.
                if dest.contains("::") && !dest.contains('/') {
                    continue;
                }
                let (path, anchor) = match dest.split_once('#') {
                    Some((path, anchor)) => (path, Some(anchor)),
                    None => (dest.as_str(), None),
                };
                let target = if path.is_empty() {
                    file.clone()
                } else if let Some(from_root) = path.strip_prefix('/') {
                    normalise(&root.join(from_root))
                } else {
                    normalise(&file.parent().expect("a file's folder").join(path))
                };
                if !target.exists() {
                    broken.push(format!("{shown}:{n}: {dest} (no such file)"));
                    continue;
                }
                let Some(anchor) = anchor else { continue };
                if target.extension().and_then(|e| e.to_str()) != Some("md") {
                    continue;
                }
                let headings = anchors(&fs::read_to_string(&target).expect("a Markdown file"));
                if !headings.iter().any(|h| h == anchor) {
                    broken.push(format!("{shown}:{n}: {dest} (no such heading)"));
                }
            }
        }
    }
    broken
}

#[test]
fn every_relative_link_in_the_repositorys_markdown_reaches_a_file_and_heading() {
    let root = normalise(&root().canonicalize().expect("the workspace root"));
    let broken = broken_links(&root);
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// Whether `dest` (`path#anchor`, the path from `root`) names an existing file and, for a
/// Markdown file, one of its anchors.
fn reaches(root: &Path, dest: &str) -> bool {
    let (path, anchor) = dest.split_once('#').unwrap_or((dest, ""));
    let target = root.join(path);
    if !target.is_file() {
        return false;
    }
    anchor.is_empty()
        || anchors(&fs::read_to_string(&target).expect("a Markdown file")).contains(&anchor.into())
}

#[test]
fn every_alerts_runbook_reaches_a_heading() {
    let root = root();
    let mut runbooks = 0;
    for file in [
        "ops/prometheus/alerts.yml",
        "ops/prometheus/alerts.test.yml",
    ] {
        let text = fs::read_to_string(root.join(file)).unwrap();
        for (n, line) in text.lines().enumerate() {
            let Some((_, dest)) = line.split_once("runbook:") else {
                continue;
            };
            let dest = dest.trim().trim_matches('"');
            runbooks += 1;
            assert!(
                reaches(&root, dest),
                "{file}:{}: {dest} reaches nothing",
                n + 1
            );
        }
    }
    assert!(runbooks > 5, "the alerts carry their runbooks");
    assert!(!reaches(&root, "docs/protocol.md#no-such-heading"));
    assert!(!reaches(&root, "docs/no-such-file.md"));
}

#[test]
fn the_link_checker_reports_a_missing_file_and_a_missing_heading() {
    let dir = std::env::temp_dir().join(format!("docs-check-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(dir.join("docs")).unwrap();
    fs::write(
        dir.join("docs/target.md"),
        "# Target\n\n<a id=\"kept\"></a>Moved.\n\n## The window, stored 5xx, and reconciliation\n\n## Twice\n\n## Twice\n",
    )
    .unwrap();
    fs::write(
        dir.join("README.md"),
        "Good: [a](docs/target.md), [b](docs/target.md#the-window-stored-5xx-and-reconciliation), \
         [c](docs/target.md#twice-1), [d](#readme), [e](https://example.com/missing.md), \
         [h](docs/target.md#kept).\n\
         Code is not a link: `[x](missing.md)`.\n\
         ```\n[y](also-missing.md)\n```\n\
         Broken: [f](docs/gone.md) and [g](docs/target.md#no-such-heading).\n\
         [ref]: ../outside-missing.md\n\n# Readme\n",
    )
    .unwrap();
    let broken = broken_links(&dir);
    fs::remove_dir_all(&dir).unwrap();
    assert_eq!(
        broken,
        [
            "README.md:6: docs/gone.md (no such file)",
            "README.md:6: docs/target.md#no-such-heading (no such heading)",
            "README.md:7: ../outside-missing.md (no such file)",
        ],
    );
}

/// The lines of `text` strictly between the line holding `from` and the next holding `to`.
fn between<'a>(text: &'a str, from: &str, to: &str) -> Vec<&'a str> {
    let lines: Vec<&str> = text.lines().collect();
    let start = lines
        .iter()
        .position(|l| l.contains(from))
        .unwrap_or_else(|| panic!("no line holds {from:?}"));
    let end = start
        + 1
        + lines[start + 1..]
            .iter()
            .position(|l| l.contains(to))
            .unwrap_or_else(|| panic!("no line after {from:?} holds {to:?}"));
    lines[start + 1..end].to_vec()
}

/// `lines` without the indentation they share.
fn dedented<'a>(lines: &[&'a str]) -> Vec<&'a str> {
    let indent = lines
        .iter()
        .filter(|l| !l.trim().is_empty())
        .map(|l| l.len() - l.trim_start().len())
        .min()
        .unwrap_or(0);
    lines
        .iter()
        .map(|l| {
            if l.len() >= indent {
                &l[indent..]
            } else {
                l.trim_start()
            }
        })
        .collect()
}

#[test]
fn the_readmes_library_code_is_the_transfer_examples_code() {
    let example =
        fs::read_to_string(root().join("crates/idempotency/examples/transfer.rs")).unwrap();
    let readme = fs::read_to_string(root().join("README.md")).unwrap();
    // The region's first line continues the marker comment; the code starts after it.
    let region = between(&example, "// README: from here", "// README: to here");
    let region: Vec<&str> = region
        .into_iter()
        .skip_while(|l| l.trim_start().starts_with("//"))
        .collect();
    // The README says where its code comes from, right above the block.
    let marker = readme
        .find("crates/idempotency/examples/transfer.rs, as they stand")
        .expect("the README names the code's source");
    let block = between(&readme[marker..], "```rust", "```");
    assert!(region.len() > 10, "the region holds the example's code");
    assert_eq!(
        block,
        dedented(&region),
        "README.md's library code differs from examples/transfer.rs between its README markers"
    );
}
