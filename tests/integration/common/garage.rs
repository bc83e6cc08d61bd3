//! A real S3-compatible server for the tests: a single-node Garage on loopback, configured in a
//! temporary directory, with a bucket and a key of its own, stopped (killed) when dropped.
//!
//! The `garage` binary is found on `PATH` or in `~/.cargo/bin` (`.ci/run` installs it there with
//! `cargo install --locked garage --version 2.5.0`). Where it is absent the tests that need it are skipped with a
//! message, unless `SAVER_REQUIRE_GARAGE=1` (set by `.ci/run`), which makes its absence a failure.

#![allow(dead_code)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running Garage server.
pub struct Garage {
    bin: PathBuf,
    dir: tempfile::TempDir,
    child: Option<Child>,
    /// `http://<host>:<port>`: loopback unless started with [`Garage::start_on`].
    pub endpoint: String,
    /// The bucket the tests write into.
    pub bucket: String,
    /// Access key id and secret of a key allowed to read and write it.
    pub key_id: String,
    pub secret: String,
    s3_host: String,
    s3_port: u16,
    rpc_port: u16,
}

static SHARED: std::sync::OnceLock<Option<&'static Garage>> = std::sync::OnceLock::new();

/// One server for every test of a test binary that uses it, with its environment set in the
/// process (library calls read `AWS_*` from it). Started by a thread that lives as long as the
/// process, so the server goes when the test binary exits, and its data directory with it (a
/// static is never dropped, so an exit handler removes it: every run used to leave ~45 MB in the
/// temporary directory, enough over many runs to fill the disk). `None` where garage is absent.
pub fn shared() -> Option<&'static Garage> {
    *SHARED.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let g: Option<&'static Garage> = Garage::start().map(|g| &*Box::leak(Box::new(g)));
            if let Some(g) = g {
                g.set_env();
                // SAFETY: registers a plain function to run at exit; it touches only the
                // initialised static.
                unsafe { libc::atexit(remove_shared) };
            }
            tx.send(g).expect("the test waits");
            loop {
                std::thread::park();
            }
        });
        rx.recv().expect("garage started or skipped")
    })
}

/// Kills the shared server and removes its directory, as the test binary exits.
extern "C" fn remove_shared() {
    if let Some(Some(g)) = SHARED.get() {
        if let Some(pid) = g.pid() {
            // SAFETY: signals and reaps the server this process started; nothing else waits
            // for it.
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGKILL);
                libc::waitpid(pid as libc::pid_t, std::ptr::null_mut(), 0);
            }
        }
        let _ = std::fs::remove_dir_all(g.dir.path());
    }
}

/// The garage binary, if installed.
pub fn garage_bin() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("SAVER_GARAGE_BIN") {
        return Some(PathBuf::from(p));
    }
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    if let Some(home) = std::env::var_os("HOME") {
        dirs.push(Path::new(&home).join(".cargo/bin"));
    }
    dirs.into_iter()
        .map(|d| d.join("garage"))
        .find(|p| p.is_file())
}

/// Times a server is started on new ports when a port it was given is taken before it binds it.
const START_ATTEMPTS: usize = 5;

/// A loopback port free now, below the range the kernel hands out for outgoing connections (read
/// from `ip_local_port_range`): a port from that range, as `bind(":0")` gives, can be taken by
/// any test's next connection before the server binds it, and once was (garage panicked with
/// `AddrInUse`).
fn free_port() -> u16 {
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let (low, high) = if ephemeral_low > 12_000 {
        (10_000, ephemeral_low)
    } else {
        (ephemeral_low, u16::MAX)
    };
    let span = u64::from(high - low);
    for _ in 0..1000 {
        let port = low + (rand_u64() % span) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port in {low}..{high}");
}

impl Garage {
    /// Starts a server, or returns `None` (after saying why) where garage is not installed and
    /// not required.
    pub fn start() -> Option<Self> {
        Self::start_on("127.0.0.1")
    }

    /// [`Garage::start`], with the S3 API on address `s3_host` (an address other network
    /// namespaces reach, for tests of many hosts).
    pub fn start_on(s3_host: &str) -> Option<Self> {
        let Some(bin) = garage_bin() else {
            if std::env::var("SAVER_REQUIRE_GARAGE").is_ok_and(|v| v == "1") {
                panic!("SAVER_REQUIRE_GARAGE=1 but no garage binary on PATH or in ~/.cargo/bin");
            }
            eprintln!(
                "skipped: no garage binary (cargo install --locked garage --version 2.5.0, or set SAVER_GARAGE_BIN)"
            );
            return None;
        };
        let mut attempt = 1;
        let mut g = loop {
            let mut g = Self::configured(bin.clone(), s3_host);
            g.spawn();
            match g.wait_until_up() {
                Ok(()) => break g,
                Err(log) if log.contains("Address already in use") && attempt < START_ATTEMPTS => {
                    // Dropped: killed, and its directory removed.
                    eprintln!("garage: a port was taken before the server bound it; new ports");
                    attempt += 1;
                }
                Err(log) => panic!("garage did not come up: {log}"),
            }
        };
        let node = g.cli(&["node", "id", "-q"]);
        let node = node
            .trim()
            .split('@')
            .next()
            .expect("a node id")
            .to_string();
        g.cli(&["layout", "assign", "-z", "dc1", "-c", "1G", &node]);
        g.cli(&["layout", "apply", "--version", "1"]);
        g.cli(&["bucket", "create", &g.bucket.clone()]);
        let key = g.cli(&["key", "create", "saver-test-key"]);
        g.key_id = field(&key, "Key ID");
        g.secret = field(&key, "Secret key");
        let bucket = g.bucket.clone();
        g.cli(&[
            "bucket",
            "allow",
            "--read",
            "--write",
            "--owner",
            &bucket,
            "--key",
            "saver-test-key",
        ]);
        g.wait_for_s3();
        Some(g)
    }

    /// A server configured on new ports in a new directory, not started.
    fn configured(bin: PathBuf, s3_host: &str) -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let (s3_port, rpc_port, admin_port) = (free_port(), free_port(), free_port());
        let g = Self {
            bin,
            dir,
            child: None,
            endpoint: format!("http://{s3_host}:{s3_port}"),
            bucket: "saver-test".into(),
            key_id: String::new(),
            secret: String::new(),
            s3_host: s3_host.to_string(),
            s3_port,
            rpc_port,
        };
        let secret: String = (0..4).map(|i| format!("{:016x}", rand_u64() ^ i)).collect();
        let config = format!(
            r#"metadata_dir = "{d}/meta"
data_dir = "{d}/data"
db_engine = "sqlite"
replication_factor = 1
rpc_bind_addr = "127.0.0.1:{rpc_port}"
rpc_public_addr = "127.0.0.1:{rpc_port}"
rpc_secret = "{secret}"

[s3_api]
s3_region = "garage"
api_bind_addr = "{s3_host}:{s3_port}"
root_domain = ".s3.garage.localhost"

[admin]
api_bind_addr = "127.0.0.1:{admin_port}"
admin_token = "saver-test-admin"
"#,
            d = g.dir.path().display()
        );
        std::fs::write(g.config(), config).expect("write garage.toml");
        g
    }

    fn config(&self) -> PathBuf {
        self.dir.path().join("garage.toml")
    }

    fn spawn(&mut self) {
        use std::os::unix::process::CommandExt;
        let log = std::fs::File::create(self.dir.path().join("garage.log")).expect("a log file");
        let mut cmd = Command::new(&self.bin);
        // SAFETY: prctl only, between fork and exec. The server dies with the thread that
        // started it, so no test run leaves one behind, even one that panics or is killed.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = cmd
            .arg("-c")
            .arg(self.config())
            .arg("server")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start garage server");
        self.child = Some(child);
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Runs a garage CLI command against the server; its stdout.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = Command::new(&self.bin)
            .arg("-c")
            .arg(self.config())
            .args(args)
            .env("RUST_LOG", "warn")
            .output()
            .expect("run garage");
        assert!(
            out.status.success(),
            "garage {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Waits until the server answers, for up to 30 s; its log if it does not, or if it exits.
    fn wait_until_up(&mut self) -> Result<(), String> {
        let start = Instant::now();
        loop {
            let ok = Command::new(&self.bin)
                .arg("-c")
                .arg(self.config())
                .arg("status")
                .env("RUST_LOG", "error")
                .output()
                .is_ok_and(|o| o.status.success());
            if ok {
                return Ok(());
            }
            let exited = self
                .child
                .as_mut()
                .is_none_or(|c| c.try_wait().is_ok_and(|status| status.is_some()));
            if exited || start.elapsed() > Duration::from_secs(30) {
                let log =
                    std::fs::read_to_string(self.dir.path().join("garage.log")).unwrap_or_default();
                let why = if exited {
                    "exited"
                } else {
                    "no answer in 30 s"
                };
                return Err(format!("{why}: {log}"));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until the S3 port accepts connections.
    fn wait_for_s3(&self) {
        let start = Instant::now();
        while std::net::TcpStream::connect((self.s3_host.as_str(), self.s3_port)).is_err() {
            assert!(start.elapsed() < Duration::from_secs(30), "no S3 port");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Kills the server (as a crash would); [`Garage::restart`] brings it back with its data.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the stopped server again, on the same ports and data.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
        if let Err(log) = self.wait_until_up() {
            panic!("garage did not come back: {log}");
        }
        self.wait_for_s3();
    }

    /// The environment a saver process needs to reach the server (`AWS_*`).
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ACCESS_KEY_ID", self.key_id.clone()),
            ("AWS_SECRET_ACCESS_KEY", self.secret.clone()),
            ("AWS_REGION", "garage".into()),
            ("AWS_ENDPOINT_URL", self.endpoint.clone()),
        ]
    }

    /// Sets [`Garage::env`] in this process (for library calls; tests that do run one server).
    pub fn set_env(&self) {
        for (k, v) in self.env() {
            std::env::set_var(k, v);
        }
    }

    /// An `object_store` client of the server's bucket with the server's own credentials (not
    /// this process's environment, which the servers of several tests would share).
    pub fn s3_client(&self) -> std::sync::Arc<object_store::aws::AmazonS3> {
        std::sync::Arc::new(
            object_store::aws::AmazonS3Builder::new()
                .with_bucket_name(&self.bucket)
                .with_region("garage")
                .with_endpoint(&self.endpoint)
                .with_allow_http(true)
                .with_access_key_id(&self.key_id)
                .with_secret_access_key(&self.secret)
                .build()
                .expect("a client of the test server"),
        )
    }

    /// `s3://<bucket>/<prefix>`.
    pub fn url(&self, prefix: &str) -> String {
        format!("s3://{}/{prefix}", self.bucket)
    }
}

impl Drop for Garage {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The value of `<name>: <value>` in a garage command's output.
fn field(out: &str, name: &str) -> String {
    out.lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == name).then(|| v.trim().to_string())
        })
        .unwrap_or_else(|| panic!("no {name:?} in garage's output:\n{out}"))
}

fn rand_u64() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as u64;
    let mut x = t ^ (u64::from(std::process::id()) << 32);
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^ (x >> 33)
}
