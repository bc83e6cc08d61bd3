//! The shape of saver-io, kept: its rooms import only from the rooms before them, in the
//! direction the data flows (storage → load → source → save → tools), and no file takes part in a
//! circle of imports. Reads the `crate::…` and `super::…` paths of every source file (comments
//! left out; `pub use` re-exports and `mod` declarations are not dependencies of the code).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The rooms, in the order data flows through them; `error` is below all.
const ROOMS: [&str; 7] = [
    "error", "storage", "load", "source", "save", "tools", "manage",
];

/// A source file's module path: `src/load/chain/table.rs` is `["load", "chain", "table"]`,
/// `src/load/mod.rs` is `["load"]`.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
        parts.pop();
    }
    parts
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The code of `text` without comments (line comments, doc comments and block comments).
fn code_of(text: &str) -> String {
    let mut out = String::new();
    let mut depth = 0;
    for line in text.lines() {
        let mut rest = line;
        let mut kept = String::new();
        loop {
            if depth > 0 {
                match rest.find("*/") {
                    Some(i) => {
                        depth -= 1;
                        rest = &rest[i + 2..];
                    }
                    None => break,
                }
            } else {
                let line_c = rest.find("//");
                let block = rest.find("/*");
                match (line_c, block) {
                    (Some(l), b) if b.is_none_or(|b| l < b) => {
                        kept.push_str(&rest[..l]);
                        break;
                    }
                    (_, Some(b)) => {
                        kept.push_str(&rest[..b]);
                        depth += 1;
                        rest = &rest[b + 2..];
                    }
                    _ => {
                        kept.push_str(rest);
                        break;
                    }
                }
            }
        }
        out.push_str(&kept);
        out.push('\n');
    }
    out
}

/// The module paths `code` names: `crate::a::b::…` and `super::…` (resolved against `module`,
/// the file's own module), including those inside `use crate::a::{b, c::d}` groups. Skips
/// `pub use` and `pub(crate) use` statements.
fn referenced(code: &str, module: &[String], is_mod_file: bool) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    // Statements, roughly: a `use` runs to its `;`.
    let mut text = String::new();
    let mut skipping = false;
    for line in code.lines() {
        let t = line.trim_start();
        if t.starts_with("pub use ")
            || t.starts_with("pub(crate) use ")
            || t.starts_with("pub(super) use ")
        {
            skipping = !t.contains(';');
            continue;
        }
        if skipping {
            skipping = !t.contains(';');
            continue;
        }
        text.push_str(line);
        text.push('\n');
    }
    let bytes: Vec<char> = text.chars().collect();
    let mut i = 0;
    while i < bytes.len() {
        let rest: String = bytes[i..bytes.len().min(i + 7)].iter().collect();
        let starts_word = i == 0 || !(bytes[i - 1].is_alphanumeric() || bytes[i - 1] == '_');
        let (base, skip) = if starts_word && rest.starts_with("crate::") {
            (Vec::new(), 7)
        } else if starts_word && rest.starts_with("super::") {
            // `super` of a `mod.rs` is the parent of its directory's module.
            let mut b = module.to_vec();
            if !is_mod_file || !b.is_empty() {
                b.pop();
            }
            let _ = is_mod_file;
            (b, 7)
        } else {
            i += 1;
            continue;
        };
        let mut j = i + skip;
        let mut path = base;
        // Repeated `super::`.
        loop {
            let more: String = bytes[j..bytes.len().min(j + 7)].iter().collect();
            if more == "super::" {
                path.pop();
                j += 7;
            } else {
                break;
            }
        }
        // Segments up to a `{`, `;`, whitespace or other punctuation.
        let mut seg = String::new();
        let mut segs = Vec::new();
        while j < bytes.len() {
            let c = bytes[j];
            if c.is_alphanumeric() || c == '_' {
                seg.push(c);
                j += 1;
            } else if c == ':' && bytes.get(j + 1) == Some(&':') {
                segs.push(std::mem::take(&mut seg));
                j += 2;
            } else {
                break;
            }
        }
        if !seg.is_empty() {
            segs.push(seg);
        }
        if bytes.get(j) == Some(&'{') {
            // A group: each member is a path below `segs`.
            let end = (j..bytes.len())
                .find(|&k| bytes[k] == ';')
                .unwrap_or(bytes.len());
            let group: String = bytes[j + 1..end].iter().collect();
            for member in group.split([',', '{', '}']) {
                let m = member.trim();
                if m.is_empty() || m == "self" {
                    out.push(path.iter().cloned().chain(segs.iter().cloned()).collect());
                    continue;
                }
                let mut p: Vec<String> = path.iter().cloned().chain(segs.iter().cloned()).collect();
                p.extend(
                    m.split("::")
                        .map(|s| s.split_whitespace().next().unwrap_or("").to_string()),
                );
                out.push(p);
            }
            i = end;
            continue;
        }
        // `use super::*` is a test module's view of the file around it.
        if !(segs.is_empty() && bytes.get(j) == Some(&'*')) {
            let mut p = path;
            p.extend(segs);
            out.push(p);
        }
        i = j;
    }
    out
}

/// The longest prefix of `path` that is a module of `modules`.
fn resolve(path: &[String], modules: &BTreeSet<Vec<String>>) -> Option<Vec<String>> {
    (1..=path.len())
        .rev()
        .map(|n| path[..n].to_vec())
        .find(|p| modules.contains(p))
}

#[test]
fn rooms_import_only_from_the_rooms_before_them_and_no_file_is_in_a_circle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let modules: BTreeMap<Vec<String>, PathBuf> = files
        .iter()
        .map(|f| (module_of(&src, f), f.clone()))
        .collect();
    let names: BTreeSet<Vec<String>> = modules.keys().cloned().collect();
    let room = |m: &[String]| -> Option<usize> {
        m.first().and_then(|r| ROOMS.iter().position(|x| x == r))
    };
    let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    let mut wrong = Vec::new();
    for (module, file) in &modules {
        if module.is_empty() {
            continue; // lib.rs: the crate's front door re-exports every room
        }
        let is_mod = file.file_name().is_some_and(|n| n == "mod.rs");
        let code = code_of(&std::fs::read_to_string(file).unwrap());
        let from = room(module).unwrap_or_else(|| panic!("{} is in no room", file.display()));
        for path in referenced(&code, module, is_mod) {
            let Some(target) = resolve(&path, &names) else {
                continue;
            };
            if target.is_empty()
                || &target == module
                || module.starts_with(&target) && is_mod && target.len() < module.len()
            {
                continue;
            }
            let to = room(&target).unwrap_or(0);
            if to > from {
                wrong.push(format!(
                    "{} (room {}) imports {} (room {}, after it)",
                    file.strip_prefix(&src).unwrap().display(),
                    ROOMS[from],
                    target.join("::"),
                    ROOMS[to]
                ));
            }
            edges.entry(module.clone()).or_default().insert(target);
        }
    }
    assert!(
        wrong.is_empty(),
        "imports against the flow:\n{}",
        wrong.join("\n")
    );
    // No circle: a depth-first search finds no edge back to a module on its stack.
    let mut state: BTreeMap<Vec<String>, u8> = BTreeMap::new();
    let mut circles = Vec::new();
    fn visit(
        m: &Vec<String>,
        edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        state: &mut BTreeMap<Vec<String>, u8>,
        stack: &mut Vec<Vec<String>>,
        circles: &mut Vec<String>,
    ) {
        state.insert(m.clone(), 1);
        stack.push(m.clone());
        for n in edges.get(m).into_iter().flatten() {
            match state.get(n) {
                Some(1) => {
                    let at = stack.iter().position(|s| s == n).unwrap();
                    let names: Vec<String> = stack[at..].iter().map(|s| s.join("::")).collect();
                    circles.push(format!("{} -> {}", names.join(" -> "), n.join("::")));
                }
                Some(_) => {}
                None => visit(n, edges, state, stack, circles),
            }
        }
        stack.pop();
        state.insert(m.clone(), 2);
    }
    for m in edges.keys() {
        if !state.contains_key(m) {
            visit(m, &edges, &mut state, &mut Vec::new(), &mut circles);
        }
    }
    assert!(
        circles.is_empty(),
        "circles of imports:\n{}",
        circles.join("\n")
    );
}

/// The checker sees what it must: a path in a group, through `super`, and not in a comment.
#[test]
fn the_checker_reads_groups_supers_and_skips_comments() {
    let module: Vec<String> = ["load", "chain", "table"].map(String::from).to_vec();
    let code = code_of(
        "use crate::save::{pipeline::save_prepared, options};\n// use crate::tools::x;\n\
         /// [`crate::tools::digest`]\nuse super::Chain;\nlet x = crate::storage::spill::f();\n",
    );
    let got = referenced(&code, &module, false);
    let joined: Vec<String> = got.iter().map(|p| p.join("::")).collect();
    assert!(
        joined.contains(&"save::pipeline::save_prepared".to_string()),
        "{joined:?}"
    );
    assert!(joined.contains(&"save::options".to_string()), "{joined:?}");
    assert!(
        joined.contains(&"load::chain::Chain".to_string()),
        "{joined:?}"
    );
    assert!(
        joined.contains(&"storage::spill::f".to_string()),
        "{joined:?}"
    );
    assert!(!joined.iter().any(|p| p.starts_with("tools")), "{joined:?}");
}
