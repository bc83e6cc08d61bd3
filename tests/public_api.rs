//! The public surface of saver-core, saver-io and the facade, kept in `tests/public_api.txt`: a
//! change to it (an item added, removed or renamed) fails this test until the snapshot is
//! written again (`SAVER_BLESS=1 cargo test -p saver --test public_api`), so that the surface
//! grows or shrinks as a reviewed decision, in the diff of that file.
//!
//! Every `pub` item of every source file is listed (functions, types, traits, constants,
//! modules, re-exports, and the `pub` methods and fields' types' methods of inherent impls),
//! under its file's module path. `pub` here is public: the crates deny `unreachable_pub`, so an
//! item that users cannot reach is `pub(crate)`. Items under `#[cfg(test)]` are left out; items
//! behind a feature are listed, with it.

use std::collections::BTreeSet;
use std::path::Path;

fn is_test_only(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg")
            && a.parse_args::<syn::Meta>()
                .is_ok_and(|m| m.path().is_ident("test"))
    })
}

/// `#[doc(hidden)]`: public only because saver-io, another crate, calls it (the core→io seam:
/// the plan's execution, the protocol's file names, the documents' checks). Such items are no
/// part of the API users are offered, carry no promise between versions, and are listed apart.
fn is_seam(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("doc") && a.parse_args::<syn::Ident>().is_ok_and(|i| i == "hidden")
    })
}

fn is_pub(v: &syn::Visibility) -> bool {
    matches!(v, syn::Visibility::Public(_))
}

/// What type an inherent impl is of, as written (`Checkpoint`, `LoadRequest`).
fn self_type(ty: &syn::Type) -> String {
    match ty {
        syn::Type::Path(p) => p
            .path
            .segments
            .last()
            .map(|s| s.ident.to_string())
            .unwrap_or_default(),
        _ => "?".into(),
    }
}

/// The `use` tree's leaves, as paths.
fn use_leaves(prefix: &str, tree: &syn::UseTree, out: &mut Vec<String>) {
    match tree {
        syn::UseTree::Path(p) => use_leaves(&format!("{prefix}{}::", p.ident), &p.tree, out),
        syn::UseTree::Name(n) => out.push(format!("{prefix}{}", n.ident)),
        syn::UseTree::Rename(r) => out.push(format!("{prefix}{} as {}", r.ident, r.rename)),
        syn::UseTree::Glob(_) => out.push(format!("{prefix}*")),
        syn::UseTree::Group(g) => g.items.iter().for_each(|t| use_leaves(prefix, t, out)),
    }
}

fn public_items(module: &str, items: &[syn::Item], out: &mut BTreeSet<String>) {
    let at = |kind: &str, name: &dyn std::fmt::Display| format!("{module} {kind} {name}");
    for item in items {
        match item {
            syn::Item::Fn(f) if is_pub(&f.vis) && !is_test_only(&f.attrs) => {
                let kind = if is_seam(&f.attrs) { "seam-fn" } else { "fn" };
                out.insert(at(kind, &f.sig.ident));
            }
            syn::Item::Struct(s) if is_pub(&s.vis) && !is_test_only(&s.attrs) => {
                out.insert(at("struct", &s.ident));
            }
            syn::Item::Enum(e) if is_pub(&e.vis) && !is_test_only(&e.attrs) => {
                out.insert(at("enum", &e.ident));
            }
            syn::Item::Trait(t) if is_pub(&t.vis) && !is_test_only(&t.attrs) => {
                out.insert(at("trait", &t.ident));
            }
            syn::Item::Type(t) if is_pub(&t.vis) && !is_test_only(&t.attrs) => {
                out.insert(at("type", &t.ident));
            }
            syn::Item::Const(c) if is_pub(&c.vis) && !is_test_only(&c.attrs) => {
                out.insert(at("const", &c.ident));
            }
            syn::Item::Static(s) if is_pub(&s.vis) && !is_test_only(&s.attrs) => {
                out.insert(at("static", &s.ident));
            }
            syn::Item::Mod(m) if !is_test_only(&m.attrs) => {
                if is_pub(&m.vis) {
                    out.insert(at("mod", &m.ident));
                }
                if let Some((_, inner)) = &m.content {
                    public_items(&format!("{module}::{}", m.ident), inner, out);
                }
            }
            syn::Item::Use(u) if is_pub(&u.vis) && !is_test_only(&u.attrs) => {
                let mut leaves = Vec::new();
                use_leaves("", &u.tree, &mut leaves);
                for l in leaves {
                    out.insert(at("use", &l));
                }
            }
            syn::Item::Impl(i) if i.trait_.is_none() && !is_test_only(&i.attrs) => {
                let ty = self_type(&i.self_ty);
                for it in &i.items {
                    if let syn::ImplItem::Fn(f) = it {
                        if is_pub(&f.vis) && !is_test_only(&f.attrs) {
                            let kind = if is_seam(&f.attrs) {
                                "seam-method"
                            } else {
                                "method"
                            };
                            out.insert(at(kind, &format!("{ty}::{}", f.sig.ident)));
                        }
                    }
                }
            }
            _ => {}
        }
    }
}

/// Every public item of the crate whose sources are under `src`, named `krate`.
fn surface(krate: &str, src: &Path, out: &mut BTreeSet<String>) {
    let mut files = Vec::new();
    rust_sources(src, &mut files);
    for f in files {
        let rel = f.strip_prefix(src).unwrap().with_extension("");
        let mut parts: Vec<String> = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
            parts.pop();
        }
        let module = std::iter::once(krate.to_string())
            .chain(parts)
            .collect::<Vec<_>>()
            .join("::");
        let text = std::fs::read_to_string(&f).unwrap();
        let file = syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        public_items(&module, &file.items, out);
    }
}

#[test]
fn the_public_api_is_the_snapshot() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut all = BTreeSet::new();
    surface("saver_core", &root.join("crates/saver-core/src"), &mut all);
    surface("saver_io", &root.join("crates/saver-io/src"), &mut all);
    surface("saver", &root.join("src"), &mut all);
    let count = |kinds: &[&str]| {
        all.iter()
            .filter(|l| kinds.iter().any(|k| l.split(' ').nth(1) == Some(k)))
            .count()
    };
    let mut text = format!(
        "# The public API (tests/public_api.rs): {} functions and methods, {} types and traits, \
         {} modules, {} re-exports; and {} functions and methods of the core→io seam \
         (`#[doc(hidden)]`, listed as seam-fn and seam-method).\n",
        count(&["fn", "method"]),
        count(&["struct", "enum", "trait", "type"]),
        count(&["mod"]),
        count(&["use"]),
        count(&["seam-fn", "seam-method"]),
    );
    for l in &all {
        text.push_str(l);
        text.push('\n');
    }
    let snapshot = root.join("tests/public_api.txt");
    if std::env::var_os("SAVER_BLESS").is_some() {
        std::fs::write(&snapshot, &text).unwrap();
        return;
    }
    let kept = std::fs::read_to_string(&snapshot).unwrap_or_default();
    if kept != text {
        let old: BTreeSet<&str> = kept.lines().skip(1).collect();
        let new: BTreeSet<&str> = text.lines().skip(1).collect();
        let added: Vec<&&str> = new.difference(&old).collect();
        let removed: Vec<&&str> = old.difference(&new).collect();
        panic!(
            "the public API changed: added {added:#?}, removed {removed:#?}; if that is meant, \
             write the snapshot again with `SAVER_BLESS=1 cargo test -p saver --test public_api` \
             and list each rename in CHANGELOG.md"
        );
    }
}

/// Every `.rs` file under `dir`.
fn rust_sources(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The seam is saver-io's alone: a hidden item that the CLI, the Python module, the facade or
/// the examples call is API that users depend on, hidden from them, and belongs in the listed
/// surface instead. (A call is the item's name followed by `(`, or a path to it.)
#[test]
fn the_seam_is_called_only_by_saver_io() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut all = BTreeSet::new();
    surface("saver_core", &root.join("crates/saver-core/src"), &mut all);
    surface("saver_io", &root.join("crates/saver-io/src"), &mut all);
    let seam: Vec<String> = all
        .iter()
        .filter(|l| matches!(l.split(' ').nth(1), Some("seam-fn" | "seam-method")))
        .map(|l| l.rsplit([' ', ':']).next().unwrap().to_string())
        .collect();
    assert!(
        !seam.is_empty(),
        "no seam item found: is_seam no longer sees `#[doc(hidden)]`"
    );
    let mut files = Vec::new();
    for dir in ["crates/saver-cli/src", "python/src", "src", "examples"] {
        rust_sources(&root.join(dir), &mut files);
    }
    let mut callers = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        for name in &seam {
            let called = text.match_indices(name.as_str()).any(|(at, _)| {
                let before = text[..at].chars().next_back();
                let after = text[at + name.len()..].trim_start();
                let word_start = !before.is_some_and(|c| c.is_alphanumeric() || c == '_');
                let word_end = !text[at + name.len()..]
                    .chars()
                    .next()
                    .is_some_and(|c| c.is_alphanumeric() || c == '_');
                word_start && word_end && (after.starts_with('(') || before == Some(':'))
            });
            if called {
                callers.push(format!("{} calls {name}", f.display()));
            }
        }
    }
    assert!(
        callers.is_empty(),
        "seam items (#[doc(hidden)]) called outside saver-io: {callers:#?}; make them part of \
         the listed API (drop `#[doc(hidden)]`) or call what users are offered"
    );
}
