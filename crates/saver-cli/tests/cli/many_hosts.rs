//! Many hosts that share nothing but an object store: each `saver` process runs in a network
//! namespace of its own (its own interfaces, addresses and host name) and reaches a Garage server
//! over a bridge, as trainer hosts reach S3. N writers save one checkpoint together, then M
//! readers in other namespaces load it with another shard count, and what they load is what a
//! local save of the same model holds.
//!
//! Needs root and `ip` (iproute2) to create namespaces, veth pairs and a bridge: elsewhere it is
//! skipped with a message, unless `SAVER_REQUIRE_NETNS=1` (set by `.ci/run`), which makes that a
//! failure. Everything it creates is named after this process and removed when it ends.

use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use crate::garage;

use garage::Garage;

/// Network namespaces joined by a bridge in the test's own namespace, which holds the
/// bridge's address (where the server listens). Removed on drop.
struct Hosts {
    bridge: String,
    namespaces: Vec<String>,
    /// The first three octets of the subnet: `10.x.y`.
    subnet: String,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Hosts {
    /// `n` namespaces, or why they cannot be made here.
    fn create(n: usize) -> Result<Self, String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("not root".into());
        }
        let tag = std::process::id() % 100_000;
        let mut hosts = Self {
            bridge: format!("svbr{tag}"),
            namespaces: Vec::new(),
            subnet: format!("10.{}.{}", 100 + tag % 100, (tag / 100) % 250),
        };
        ip(&["link", "add", &hosts.bridge, "type", "bridge"])?;
        let addr = format!("{}.1/24", hosts.subnet);
        ip(&["addr", "add", &addr, "dev", &hosts.bridge])?;
        ip(&["link", "set", &hosts.bridge, "up"])?;
        for i in 0..n {
            let ns = format!("saver{tag}h{i}");
            ip(&["netns", "add", &ns])?;
            hosts.namespaces.push(ns.clone());
            let (outside, inside) = (format!("sv{tag}h{i}o"), format!("sv{tag}h{i}i"));
            ip(&[
                "link", "add", &outside, "type", "veth", "peer", "name", &inside,
            ])?;
            ip(&["link", "set", &inside, "netns", &ns])?;
            ip(&["link", "set", &outside, "master", &hosts.bridge])?;
            ip(&["link", "set", &outside, "up"])?;
            let addr = format!("{}.{}/24", hosts.subnet, 10 + i);
            ip(&["-n", &ns, "addr", "add", &addr, "dev", &inside])?;
            ip(&["-n", &ns, "link", "set", &inside, "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(hosts)
    }

    /// The bridge's address: the server's, seen from every namespace.
    fn server_addr(&self) -> String {
        format!("{}.1", self.subnet)
    }

    /// `saver args` in namespace `i`, under host name `host-i` (a UTS namespace of its own), with
    /// the server's environment.
    fn saver(&self, i: usize, g: &Garage, args: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.namespaces[i]])
            .args([
                "unshare",
                "--uts",
                "sh",
                "-c",
                "hostname \"$0\" && exec \"$@\"",
            ])
            .arg(format!("host-{i}"))
            .arg(env!("CARGO_BIN_EXE_saver"))
            .args(args)
            .envs(g.env())
            // Not loopback: plain HTTP must be allowed explicitly.
            .env("AWS_ALLOW_HTTP", "true");
        c
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for ns in &self.namespaces {
            let _ = ip(&["netns", "del", ns]);
        }
        let _ = ip(&["link", "del", &self.bridge]);
    }
}

fn finished(what: &str, child: Child) -> String {
    let out: Output = child.wait_with_output().expect("wait");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{what} failed: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

fn json_field(text: &str, field: &str) -> serde_json::Value {
    let v: serde_json::Value = serde_json::from_str(text.trim())
        .unwrap_or_else(|e| panic!("not one JSON object ({e}): {text}"));
    v[field].clone()
}

/// `saver args` in the test's own namespace (against the server, if given).
fn local_saver(g: Option<&Garage>, args: &[&str]) -> String {
    let mut c = Command::new(env!("CARGO_BIN_EXE_saver"));
    c.args(args);
    if let Some(g) = g {
        c.envs(g.env()).env("AWS_ALLOW_HTTP", "true");
    }
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

#[test]
fn writers_and_readers_on_separate_hosts_share_one_checkpoint_in_the_store() {
    const WRITERS: usize = 3;
    const READERS: usize = 2;
    let hosts = match Hosts::create(WRITERS + READERS) {
        Ok(h) => h,
        Err(why) => {
            assert!(
                std::env::var("SAVER_REQUIRE_NETNS").map_or(true, |v| v != "1"),
                "SAVER_REQUIRE_NETNS=1 but network namespaces cannot be made: {why}"
            );
            eprintln!("skipped: network namespaces cannot be made here ({why})");
            return;
        }
    };
    let Some(g) = Garage::start_on(&hosts.server_addr()) else {
        return;
    };
    let model = "tables=4,rows=60000,dim=16,slots=embedding+adagrad,dense=4MiB,seed=11";

    // The reference: the same model saved to a local disk.
    let local = tempfile::tempdir().unwrap();
    let local_ck = local.path().join("ck");
    let local_ck = local_ck.to_str().unwrap();
    local_saver(None, &["save", "--synthetic", model, "--out", local_ck]);
    let want_digest = local_saver(None, &["digest", local_ck]).trim().to_string();

    for round in 0..3 {
        let url = g.url(&format!("hosts/ck{round}"));
        let save_id = format!("hosts-r{round}");
        let shards = WRITERS.to_string();
        // Every writer at once, with varied starts, on its own host.
        let writers: Vec<Child> = (0..WRITERS)
            .map(|i| {
                std::thread::sleep(Duration::from_millis((round * 37 + i as u64 * 23) % 60));
                let index = i.to_string();
                hosts
                    .saver(
                        i,
                        &g,
                        &[
                            "save",
                            "--synthetic",
                            model,
                            "--shards",
                            &shards,
                            "--shard-index",
                            &index,
                            "--save-id",
                            &save_id,
                            "--wait-seconds",
                            "120",
                            "--json",
                            "--out",
                            &url,
                        ],
                    )
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let mut committed_here = 0;
        for (i, w) in writers.into_iter().enumerate() {
            let report = finished(&format!("writer {i}"), w);
            assert_eq!(json_field(&report, "committed"), true, "{report}");
            committed_here += usize::from(json_field(&report, "committed_here") == true);
        }
        // At least one writes the index; on a store without conditional creation (Garage)
        // several may, writing the same bytes (the commit is idempotent).
        assert!(committed_here >= 1, "no writer committed");

        // The manifest names the writers' hosts: three hosts wrote one save.
        let inspect = local_saver(Some(&g), &["inspect", "--json", &url]);
        for i in 0..WRITERS {
            assert!(inspect.contains(&format!("host-{i}")), "{inspect}");
        }

        // Readers on other hosts, with another shard count, all at once.
        let readers: Vec<Child> = (0..READERS)
            .map(|j| {
                let index = j.to_string();
                let m = READERS.to_string();
                hosts
                    .saver(
                        WRITERS + j,
                        &g,
                        &[
                            "load",
                            &url,
                            "--shards",
                            &m,
                            "--shard-index",
                            &index,
                            "--json",
                        ],
                    )
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for (j, r) in readers.into_iter().enumerate() {
            let report = finished(&format!("reader {j}"), r);
            let want = local_saver(
                None,
                &[
                    "load",
                    local_ck,
                    "--shards",
                    &READERS.to_string(),
                    "--shard-index",
                    &j.to_string(),
                    "--json",
                ],
            );
            assert_eq!(
                json_field(&report, "digest"),
                json_field(&want, "digest"),
                "reader {j} of {READERS}"
            );
            assert_eq!(json_field(&report, "rows"), json_field(&want, "rows"));
            let amp = json_field(&report, "read_amplification").as_f64().unwrap();
            assert!(amp <= 1.1, "read amplification {amp}");
        }
        let out = hosts
            .saver(WRITERS, &g, &["digest", &url])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), want_digest);
    }
}
