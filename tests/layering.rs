//! The shape of saver-core and saver-io, kept: each crate's rooms (its top-level modules) import
//! only from the rooms before them, in the direction data flows, and no file takes part in a
//! circle of imports.
//!
//! The check parses every source file (syn) and follows every path the code names: `use` trees,
//! paths in expressions, types and patterns, `pub use` and `pub(crate) use` re-exports (a
//! re-export of a later room is an import of it), and paths through re-exports, the crate root's
//! included (`crate::CheckpointManager` is an import of `manage`). Each path is resolved to the
//! file that defines what it names. Left out: comments and doc links, visibility paths
//! (`pub(in crate::load)`), and items under `#[cfg(test)]`, which are no part of the library a
//! user builds (a lower room's unit tests may build their fixtures with a higher room).
//!
//! A file's use of its own directory's `mod.rs` (a child using its parent's shared items) is no
//! edge of the circle search: a module and the files it is split into are one unit, and the
//! parent's use of its children is how it is composed. Circles among siblings and cousins are the
//! tangles the check is for.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use syn::visit::Visit;

/// saver-core's rooms, lowest first: the data model, then what builds on it.
const CORE_ROOMS: &[&str] = &[
    "error",
    "dtype",
    "cast",
    "naming",
    "partition",
    "moment_copy",
    "tensor",
    "compress",
    "quantize",
    "prefetch",
    "table",
    "filter",
    "row_range",
    "manifest",
    "plan",
    "synthetic",
];

/// saver-io's rooms, in the order data flows through them; `error` is below all.
const IO_ROOMS: &[&str] = &[
    "error", "storage", "load", "source", "save", "tools", "manage",
];

type Module = Vec<String>;

/// A source file's module path: `src/load/chain/table.rs` is `["load", "chain", "table"]`,
/// `src/load/mod.rs` is `["load"]`, `src/lib.rs` is `[]`.
fn module_of(src: &Path, file: &Path) -> Module {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Module = rel
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

/// What one file names: the paths its code uses, and the re-exports it makes.
#[derive(Default)]
struct Named {
    /// Absolute paths (from the crate root) the code uses.
    uses: Vec<Module>,
    /// `pub use` / `pub(crate) use` / `pub(super) use`: (the name it is seen by, its target).
    reexports: Vec<(String, Module)>,
}

/// Collects paths, with the module the code sits in (inline `mod x { … }` blocks deepen it).
struct Collector<'a> {
    module: Module,
    /// Every module of the crate, to tell a relative `child::x` path from an extern crate's.
    modules: &'a BTreeSet<Module>,
    named: Named,
}

impl Collector<'_> {
    /// An absolute path for `segs` as written in `self.module`, or `None` for a path outside
    /// the crate (std, other crates) or a local name.
    fn absolute(&self, segs: &[String]) -> Option<Module> {
        let first = segs.first()?;
        let mut base = match first.as_str() {
            "crate" => Vec::new(),
            "self" => self.module.clone(),
            "super" => {
                let mut b = self.module.clone();
                b.pop()?;
                b
            }
            _ => {
                // `child::x` from the parent (2018 paths), if `child` is a module of the crate.
                let mut m = self.module.clone();
                m.push(first.clone());
                if segs.len() > 1 && self.modules.contains(&m) {
                    return Some(
                        self.module
                            .iter()
                            .cloned()
                            .chain(segs.iter().cloned())
                            .collect(),
                    );
                }
                return None;
            }
        };
        let mut rest = &segs[1..];
        while rest.first().is_some_and(|s| s == "super") {
            base.pop()?;
            rest = &rest[1..];
        }
        base.extend(rest.iter().cloned());
        Some(base)
    }

    /// Walks a `use` tree, calling `found` with each whole path and the name it binds.
    fn use_tree(prefix: &mut Vec<String>, tree: &syn::UseTree, found: &mut Vec<(Module, String)>) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                Self::use_tree(prefix, &p.tree, found);
                prefix.pop();
            }
            syn::UseTree::Name(n) => {
                let name = n.ident.to_string();
                if name == "self" {
                    let bound = prefix.last().cloned().unwrap_or_default();
                    found.push((prefix.clone(), bound));
                } else {
                    let mut p = prefix.clone();
                    p.push(name.clone());
                    found.push((p, name));
                }
            }
            syn::UseTree::Rename(r) => {
                let mut p = prefix.clone();
                if r.ident != "self" {
                    p.push(r.ident.to_string());
                }
                found.push((p, r.rename.to_string()));
            }
            syn::UseTree::Glob(_) => found.push((prefix.clone(), "*".into())),
            syn::UseTree::Group(g) => {
                for t in &g.items {
                    Self::use_tree(prefix, t, found);
                }
            }
        }
    }
}

/// `#[cfg(test)]`.
fn is_test_only(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg") && a.parse_args::<syn::Ident>().is_ok_and(|i| i == "test")
    })
}

impl<'ast> Visit<'ast> for Collector<'_> {
    fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
        if !is_test_only(&f.attrs) {
            syn::visit::visit_item_fn(self, f);
        }
    }

    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        if is_test_only(&u.attrs) {
            return;
        }
        let mut found = Vec::new();
        let mut prefix = Vec::new();
        if u.leading_colon.is_some() {
            return; // `::other_crate::…`
        }
        Self::use_tree(&mut prefix, &u.tree, &mut found);
        let public = !matches!(u.vis, syn::Visibility::Inherited);
        for (path, bound) in found {
            let Some(abs) = self.absolute(&path) else {
                continue;
            };
            if public {
                self.named.reexports.push((bound, abs));
            } else if bound == "*" && path.len() == 1 && path[0] == "super" {
                // `use super::*;`: a test module's view of the file around it.
            } else {
                self.named.uses.push(abs);
            }
        }
    }

    fn visit_visibility(&mut self, _: &'ast syn::Visibility) {}

    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        if is_test_only(&m.attrs) {
            return;
        }
        if m.content.is_some() {
            self.module.push(m.ident.to_string());
            syn::visit::visit_item_mod(self, m);
            self.module.pop();
        }
    }

    fn visit_path(&mut self, p: &'ast syn::Path) {
        if p.leading_colon.is_none() && p.segments.len() > 1 {
            let segs: Vec<String> = p.segments.iter().map(|s| s.ident.to_string()).collect();
            if let Some(abs) = self.absolute(&segs) {
                self.named.uses.push(abs);
            }
        }
        syn::visit::visit_path(self, p);
    }

    fn visit_macro(&mut self, m: &'ast syn::Macro) {
        // Paths inside macro calls (`format!("{}", crate::x::y())`, `matches!(e, crate::X)`):
        // read the tokens as a sequence of paths.
        let text = m.tokens.to_string();
        for word in text.split(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':' || c == ' '))
        {
            let compact: String = word.split_whitespace().collect();
            let segs: Vec<String> = compact.split("::").map(String::from).collect();
            if segs.len() > 1
                && segs.iter().all(|s| !s.is_empty())
                && matches!(segs[0].as_str(), "crate" | "super" | "self")
            {
                if let Some(abs) = self.absolute(&segs) {
                    self.named.uses.push(abs);
                }
            }
        }
        syn::visit::visit_macro(self, m);
    }
}

/// The crate's files, what each names, and its re-exports by (module, name).
struct Crate {
    src: PathBuf,
    files: BTreeMap<Module, PathBuf>,
    named: BTreeMap<Module, Named>,
    /// (module, name) → the path it re-exports.
    reexports: BTreeMap<(Module, String), Module>,
    /// Modules that re-export everything of another (`pub use x::*`).
    globs: BTreeMap<Module, Vec<Module>>,
}

impl Crate {
    fn read(src: PathBuf) -> Crate {
        let mut paths = Vec::new();
        rust_files(&src, &mut paths);
        let files: BTreeMap<Module, PathBuf> = paths
            .iter()
            .map(|f| (module_of(&src, f), f.clone()))
            .collect();
        let modules: BTreeSet<Module> = files.keys().cloned().collect();
        let mut named = BTreeMap::new();
        let mut reexports = BTreeMap::new();
        let mut globs: BTreeMap<Module, Vec<Module>> = BTreeMap::new();
        for (module, file) in &files {
            let text = std::fs::read_to_string(file).unwrap();
            let ast = syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            let mut c = Collector {
                module: module.clone(),
                modules: &modules,
                named: Named::default(),
            };
            c.visit_file(&ast);
            for (name, target) in &c.named.reexports {
                if name == "*" {
                    globs
                        .entry(module.clone())
                        .or_default()
                        .push(target.clone());
                } else {
                    reexports.insert((module.clone(), name.clone()), target.clone());
                }
            }
            named.insert(module.clone(), c.named);
        }
        Crate {
            src,
            files,
            named,
            reexports,
            globs,
        }
    }

    /// The file (module) that defines what `path` names, following re-exports.
    fn resolve(&self, path: &[String]) -> Option<Module> {
        let mut path = path.to_vec();
        for _ in 0..16 {
            let n = (0..=path.len())
                .rev()
                .find(|&n| self.files.contains_key(&path[..n]))?;
            let module = path[..n].to_vec();
            let Some(name) = path.get(n) else {
                return Some(module);
            };
            match self.reexports.get(&(module.clone(), name.clone())) {
                Some(target) => {
                    let mut next = target.clone();
                    next.extend(path[n + 1..].iter().cloned());
                    if next == path {
                        return Some(module);
                    }
                    path = next;
                }
                None => {
                    // Through a glob re-export, if the glob's module has the name.
                    let through = self.globs.get(&module).into_iter().flatten().find_map(|g| {
                        let mut p = g.clone();
                        p.extend(path[n..].iter().cloned());
                        let m = self.resolve(&p)?;
                        (m != module).then_some(m)
                    });
                    return Some(through.unwrap_or(module));
                }
            }
        }
        None
    }

    /// Imports against the rooms' order, and circles among the files.
    fn check(&self, rooms: &[&str]) -> (Vec<String>, Vec<String>) {
        let room = |m: &[String]| m.first().and_then(|r| rooms.iter().position(|x| x == r));
        let name = |m: &Module| {
            if m.is_empty() {
                "lib.rs".to_string()
            } else {
                m.join("::")
            }
        };
        let mut wrong = BTreeSet::new();
        let mut edges: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
        for (module, named) in &self.named {
            let file = self.files[module]
                .strip_prefix(&self.src)
                .unwrap()
                .display();
            let Some(from) = room(module) else {
                assert!(
                    module.is_empty(),
                    "{file} is in no room: add it to the rooms"
                );
                continue; // lib.rs: the crate's front door re-exports every room
            };
            let reexported = named.reexports.iter().map(|(_, p)| (p, true));
            for (path, is_reexport) in named.uses.iter().map(|p| (p, false)).chain(reexported) {
                let Some(target) = self.resolve(path) else {
                    continue;
                };
                if target.is_empty() {
                    continue;
                }
                let to = room(&target).unwrap_or(0);
                if to > from {
                    wrong.insert(format!(
                        "{file} (room {}) {} {} (room {}, after it)",
                        rooms[from],
                        if is_reexport { "re-exports" } else { "imports" },
                        name(&target),
                        rooms[to]
                    ));
                }
                // A re-export passes a name on; what uses it is resolved to its definition, so
                // the pass-through itself is no edge of the graph (a `mod.rs` re-exporting its
                // children while they use its items is no circle).
                if !is_reexport && !module.starts_with(&target) {
                    edges.entry(module.clone()).or_default().insert(target);
                }
            }
        }
        (wrong.into_iter().collect(), circles(&edges))
    }
}

/// Every circle a depth-first search finds (an edge back to a module on its stack).
fn circles(edges: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<String> {
    fn visit(
        m: &Module,
        edges: &BTreeMap<Module, BTreeSet<Module>>,
        state: &mut BTreeMap<Module, u8>,
        stack: &mut Vec<Module>,
        out: &mut Vec<String>,
    ) {
        state.insert(m.clone(), 1);
        stack.push(m.clone());
        for n in edges.get(m).into_iter().flatten() {
            match state.get(n) {
                Some(1) => {
                    let at = stack.iter().position(|s| s == n).unwrap();
                    let names: Vec<String> = stack[at..].iter().map(|s| s.join("::")).collect();
                    out.push(format!("{} -> {}", names.join(" -> "), n.join("::")));
                }
                Some(_) => {}
                None => visit(n, edges, state, stack, out),
            }
        }
        stack.pop();
        state.insert(m.clone(), 2);
    }
    let mut state = BTreeMap::new();
    let mut out = Vec::new();
    for m in edges.keys() {
        if !state.contains_key(m) {
            visit(m, edges, &mut state, &mut Vec::new(), &mut out);
        }
    }
    out
}

fn crate_src(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("crates")
        .join(name)
        .join("src")
}

fn assert_shape(name: &str, rooms: &[&str]) {
    let (wrong, circles) = Crate::read(crate_src(name)).check(rooms);
    assert!(
        wrong.is_empty(),
        "{name}: imports against the flow ({}):\n{}",
        rooms.join(" → "),
        wrong.join("\n")
    );
    assert!(
        circles.is_empty(),
        "{name}: circles of imports:\n{}",
        circles.join("\n")
    );
}

#[test]
fn saver_io_rooms_import_only_from_the_rooms_before_them_and_no_file_is_in_a_circle() {
    assert_shape("saver-io", IO_ROOMS);
}

#[test]
fn saver_core_rooms_import_only_from_the_rooms_before_them_and_no_file_is_in_a_circle() {
    assert_shape("saver-core", CORE_ROOMS);
}

/// The checker sees the violations a reader could slip past a text search: each is injected into
/// a copy of saver-io's sources and must be reported.
#[test]
fn the_checker_catches_every_kind_of_violation() {
    let cases: &[(&str, &str, &str)] = &[
        // An import through the crate root's re-exports.
        (
            "storage/mod.rs",
            "use crate::CheckpointManager;",
            "imports manage",
        ),
        // A re-export of a later room, public or to the crate.
        (
            "storage/mod.rs",
            "pub use crate::save::SaveOptions;",
            "re-exports save",
        ),
        (
            "load/mod.rs",
            "pub(crate) use crate::tools::digest;",
            "re-exports tools",
        ),
        // A path in an expression, through `super`, and in a group.
        (
            "storage/local.rs",
            "fn f() { let _ = super::super::manage::Root::open; }",
            "imports manage",
        ),
        (
            "load/stored.rs",
            "use crate::{error::Error, source::Source};",
            "imports source",
        ),
        // A path inside a macro call.
        (
            "storage/local.rs",
            "fn g() { println!(\"{:?}\", crate::tools::digest::digest); }",
            "imports tools",
        ),
    ];
    for (file, line, expect) in cases {
        let dir = tempfile::tempdir().unwrap();
        copy_tree(&crate_src("saver-io"), dir.path());
        let target = dir.path().join(file);
        let mut text = std::fs::read_to_string(&target).unwrap();
        text.push_str(&format!("\n{line}\n"));
        std::fs::write(&target, text).unwrap();
        let (wrong, _) = Crate::read(dir.path().to_path_buf()).check(IO_ROOMS);
        assert!(
            wrong
                .iter()
                .any(|w| w.contains(expect) && w.starts_with(file)),
            "{line} in {file}: not reported as `{expect}`: {wrong:?}"
        );
    }
    // Comments and doc links are not imports; a circle between two files is reported.
    let dir = tempfile::tempdir().unwrap();
    copy_tree(&crate_src("saver-io"), dir.path());
    let append = |file: &str, line: &str| {
        let p = dir.path().join(file);
        let mut text = std::fs::read_to_string(&p).unwrap();
        text.push_str(line);
        std::fs::write(&p, text).unwrap();
    };
    append(
        "storage/local.rs",
        "\n// use crate::tools::x;\n/// [`crate::manage::Root`]\nfn h() {}\n",
    );
    let (wrong, circles) = Crate::read(dir.path().to_path_buf()).check(IO_ROOMS);
    assert!(wrong.is_empty(), "{wrong:?}");
    assert!(circles.is_empty(), "{circles:?}");
    append(
        "storage/local.rs",
        "\nfn c1() { let _ = crate::storage::spill::Spill::new; }\n",
    );
    append(
        "storage/spill.rs",
        "\nfn c2() { let _ = crate::storage::local::LocalStorage::new; }\n",
    );
    let (_, circles) = Crate::read(dir.path().to_path_buf()).check(IO_ROOMS);
    assert!(
        circles
            .iter()
            .any(|c| c.contains("storage::local") && c.contains("storage::spill")),
        "{circles:?}"
    );
}

fn copy_tree(from: &Path, to: &Path) {
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.path().is_dir() {
            std::fs::create_dir_all(&dest).unwrap();
            copy_tree(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), dest).unwrap();
        }
    }
}
