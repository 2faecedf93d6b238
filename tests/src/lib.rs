//! `TestVm`: boots a real guest with the `tandem` binary on /dev/kvm and
//! talks to it over its serial console, as a user at a terminal would.
//!
//! Boots cost half a minute or more on hosts whose KVM emulates the guest kernel,
//! so a test boots once and runs many checks, and tests that are not about
//! booting restore the run's base snapshot instead ([`base`]). Commands run one at a time
//! (see docs/host-kvm.md). The VMM process is always killed on drop.

pub mod base;
pub mod colo;
pub mod hosts;
pub mod netns;
pub mod pki;
pub mod rtc;
pub mod stream;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// The marker the default guest's /init prints when user space is up.
pub const READY: &str = "tandem-guest: ready";
/// How much slower than on an idle host a guest may run here before a wait
/// gives up. CI machines are shared: with one core kept busy beside the
/// suite (which runs two guests at once), guests ran 1.5-3x slower than
/// alone (issue 11), so every wait allows 5x what it needs on an idle host.
pub const LOAD_MARGIN: u32 = 5;
/// A wait for something that takes `idle` on an idle host.
pub const fn budget(idle: Duration) -> Duration {
    Duration::from_secs(idle.as_secs() * LOAD_MARGIN as u64)
}
/// Boot budget: the default guest reaches its ready marker in about 40 s
/// on an idle host (its bzImage in about 60 s).
pub const BOOT_TIMEOUT: Duration = budget(Duration::from_secs(120));
/// Budget of one console command on the default guest (most take well
/// under a second; the slowest, a few hundred execs, about 60 s).
pub const CMD_TIMEOUT: Duration = budget(Duration::from_secs(60));
/// How long a failed wait gives the guest's shell to show its kernel log
/// and processes (see `TestVm::last_look`).
const LAST_LOOK: Duration = Duration::from_secs(30);

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// Whether tandem treats this host as emulated (`kvm_pvm`, or
/// `TANDEM_HOST_KIND=emulated`): the rule of `vmm/src/host_emu/mod.rs`.
pub fn host_is_emulated() -> bool {
    match std::env::var("TANDEM_HOST_KIND").as_deref() {
        Ok("hardware") => false,
        Ok("emulated") => true,
        _ => std::path::Path::new("/sys/module/kvm_pvm").exists(),
    }
}

/// The `tandem` binary built by the test command (same profile as the tests).
pub fn tandem_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> -> target/<profile>/tandem
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .map(|p| p.join("tandem"))
        .expect("target directory");
    assert!(
        bin.is_file(),
        "{} is missing: build it first (./test.sh does: cargo build --release -p vmm)",
        bin.display()
    );
    bin
}

/// The default guest's files in target/guest.
pub fn guest_file(name: &str) -> PathBuf {
    let p = repo_root().join("target/guest").join(name);
    assert!(
        p.is_file(),
        "{} is missing: run resources/build-guest.sh (./test.sh does)",
        p.display()
    );
    p
}

/// Fails the test, loudly, when there is no KVM: guest tests never pass
/// without a guest.
pub fn require_kvm() {
    assert!(
        Path::new("/dev/kvm").exists(),
        "/dev/kvm is absent: these tests boot real guests under KVM and cannot run here"
    );
}

#[derive(Default)]
struct Output {
    bytes: Vec<u8>,
    closed: bool,
}

type Shared = Arc<(Mutex<Output>, Condvar)>;

fn collect(mut r: impl Read + Send + 'static, out: Shared) {
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        loop {
            let n = r.read(&mut buf).unwrap_or(0);
            let (m, cv) = &*out;
            let mut o = m.lock().unwrap();
            if n == 0 {
                o.closed = true;
                cv.notify_all();
                return;
            }
            o.bytes.extend_from_slice(&buf[..n]);
            cv.notify_all();
        }
    });
}

/// A running `tandem run` with a guest behind its console.
pub struct TestVm {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: Shared,
    stderr: Shared,
    /// Where in stdout the next search starts.
    cursor: usize,
    seq: u32,
    /// Files removed after the VMM is killed (e.g. a disk copy).
    scratch: Vec<PathBuf>,
    /// Its `--api-sock`, removed after it unless another live VM uses the
    /// same path (a killed VMM leaves its socket file behind).
    api_sock: Option<PathBuf>,
}

/// `DIR:rw` for the directory of `args`' `--api-sock`, when `args` name
/// no `--landlock*` option.
fn landlock_rule_for_api_dir(args: &[&str]) -> Option<String> {
    if args.iter().any(|a| a.starts_with("--landlock")) {
        return None;
    }
    let i = args.iter().position(|a| *a == "--api-sock")?;
    let dir = std::path::absolute(args.get(i + 1)?).ok()?;
    Some(format!("{}:rw", dir.parent()?.display()))
}

/// The `--api-sock` paths of live [`TestVm`]s, with how many use each.
fn api_socks() -> &'static Mutex<std::collections::HashMap<PathBuf, usize>> {
    static SOCKS: std::sync::OnceLock<Mutex<std::collections::HashMap<PathBuf, usize>>> =
        std::sync::OnceLock::new();
    SOCKS.get_or_init(Default::default)
}

impl TestVm {
    /// Starts `tandem run <args>` with piped stdio.
    pub fn start(args: &[&str]) -> TestVm {
        Self::start_with(Command::new(tandem_bin()), args)
    }

    /// Starts `tandem run <args>` through `cmd` (e.g. `ip netns exec NS tandem`).
    ///
    /// Its API socket's directory is the test's scratch directory, where
    /// its snapshots, reverts and profiles go: unless `args` say
    /// something of Landlock, it gets `--landlock-rule DIR:rw` for it, as
    /// a user names the directory their snapshots go to.
    pub fn start_with(mut cmd: Command, args: &[&str]) -> TestVm {
        require_kvm();
        let scratch_rule = landlock_rule_for_api_dir(args);
        let mut child = cmd
            .arg("run")
            .args(args)
            .args(
                scratch_rule
                    .iter()
                    .flat_map(|r| ["--landlock-rule", r.as_str()]),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn tandem");
        let stdout: Shared = Arc::default();
        let stderr: Shared = Arc::default();
        collect(child.stdout.take().unwrap(), stdout.clone());
        collect(child.stderr.take().unwrap(), stderr.clone());
        let stdin = child.stdin.take();
        let api_sock = args
            .iter()
            .position(|a| *a == "--api-sock")
            .and_then(|i| args.get(i + 1))
            .map(PathBuf::from);
        if let Some(p) = &api_sock {
            *api_socks().lock().unwrap().entry(p.clone()).or_default() += 1;
        }
        TestVm {
            child,
            stdin,
            stdout,
            stderr,
            cursor: 0,
            seq: 0,
            scratch: Vec::new(),
            api_sock,
        }
    }

    /// Boots the default guest (ELF vmlinux and initramfs) with `extra` args
    /// and waits for its shell.
    pub fn boot_default(extra: &[&str]) -> TestVm {
        let kernel = guest_file("vmlinux");
        let initrd = guest_file("initramfs.cpio");
        let mut args = vec![
            "--kernel",
            kernel.to_str().unwrap(),
            "--initrd",
            initrd.to_str().unwrap(),
            "--mem",
            "128M",
        ];
        args.extend_from_slice(extra);
        let mut vm = TestVm::start(&args);
        vm.wait_ready();
        vm
    }

    /// Starts `tandem run --restore <file> <extra>` and syncs with the
    /// restored guest's shell by running a command on its console (a
    /// restored guest prints no ready marker).
    pub fn restore(file: &Path, extra: &[&str]) -> TestVm {
        let mut args = vec!["--restore", file.to_str().expect("UTF-8 path")];
        args.extend_from_slice(extra);
        let mut vm = TestVm::start(&args);
        vm.ok("true", CMD_TIMEOUT);
        vm
    }

    /// Removes `path` when this VM is dropped (after the VMM is killed).
    pub fn remove_on_drop(&mut self, path: PathBuf) {
        self.scratch.push(path);
    }

    /// The VMM's process id.
    /// Whether the VMM process still runs.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The VMM's own memory in KiB: the process RSS minus the RSS of guest
    /// RAM, from /proc/PID/smaps. Guest RAM is a run of adjacent mappings
    /// at least `guest_kib` large in all: one mapping after a boot, several
    /// after a restore that mapped the snapshot's pages over parts of it.
    pub fn vmm_overhead_kib(&self, guest_kib: u64) -> u64 {
        let smaps =
            std::fs::read_to_string(format!("/proc/{}/smaps", self.pid())).expect("read smaps");
        // (start, end, rss in KiB) of each mapping, in address order.
        let mut maps: Vec<(u64, u64, u64)> = Vec::new();
        for line in smaps.lines() {
            let range = line
                .split_whitespace()
                .next()
                .and_then(|r| r.split_once('-'));
            let hex = |v: &str| u64::from_str_radix(v, 16).ok();
            if let Some((Some(start), Some(end))) = range.map(|(a, b)| (hex(a), hex(b))) {
                maps.push((start, end, 0));
            } else if let (Some(rss), Some(last)) = (line.strip_prefix("Rss:"), maps.last_mut()) {
                last.2 = rss
                    .split_whitespace()
                    .next()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
            }
        }
        let total: u64 = maps.iter().map(|m| m.2).sum();
        let mut guest = 0;
        let mut i = 0;
        while i < maps.len() {
            // The run of adjacent mappings that starts at i.
            let mut j = i + 1;
            while j < maps.len() && maps[j].0 == maps[j - 1].1 {
                j += 1;
            }
            if (maps[j - 1].1 - maps[i].0) >> 10 >= guest_kib {
                guest += maps[i..j].iter().map(|m| m.2).sum::<u64>();
            }
            i = j;
        }
        total - guest
    }

    /// Waits for the ready marker, then turns console echo off so that
    /// command output is clean, and makes the console shell one that a
    /// background job's end cannot kill.
    ///
    /// With echo off, busybox ash reads its commands with `fgets` (its
    /// line editor steps aside), and its SIGCHLD handler has no
    /// `SA_RESTART`: a job that ends while the shell waits at the prompt
    /// breaks that read with EINTR, which ash takes for end of input, and
    /// the console shell exits (init starts another, without the first
    /// one's variables and jobs, and a command typed meanwhile is lost).
    /// An interactive ash that reads its commands from a file, here the
    /// console opened again, reads with `safe_read`, which retries on
    /// EINTR. Such a shell prints no prompt; [`strip_prompt`] takes either.
    pub fn wait_ready(&mut self) {
        self.wait_for(READY, BOOT_TIMEOUT);
        self.run("stty -echo", CMD_TIMEOUT);
        self.send("exec /bin/sh -i /proc/self/fd/0\n");
        self.run("true", CMD_TIMEOUT);
    }

    /// Fails the test if the guest's boot logged a fault: a kernel log line
    /// (`dmesg -r`) at level err or worse or naming one of [`FAULT_WORDS`],
    /// or such a word on the console before the ready marker. Prints every
    /// offending line. The guest's awk passes on only the lines that may
    /// be faults (the whole log through the emulated serial port took
    /// 1.3 s on a PCI machine here, the awk 0.2 s); [`fault_lines`]
    /// decides. One process at a time (README, known issues).
    pub fn assert_clean_boot(&mut self) {
        let log = self.ok(
            "dmesg -r >/tmp/kernel.log; \
             awk -F'[<>]' '/^</ && $2 % 8 < 4 || /Error|Fatal|BUG|WARNING|Call Trace/' \
             /tmp/kernel.log; rm /tmp/kernel.log",
            CMD_TIMEOUT,
        );
        let console = self.console();
        let boot = console.split(READY).next().unwrap_or("");
        let mut bad = fault_lines(&log);
        bad.extend(
            boot.lines()
                .filter(|l| FAULT_WORDS.iter().any(|w| l.contains(w)))
                .map(|l| format!("console: {l}")),
        );
        assert!(
            bad.is_empty(),
            "the guest's boot logged {} fault line(s):\n{}",
            bad.len(),
            bad.join("\n")
        );
    }

    /// All console output so far, with `\r` removed.
    pub fn console(&self) -> String {
        let o = self.stdout.0.lock().unwrap();
        String::from_utf8_lossy(&o.bytes).replace('\r', "")
    }

    /// What the VMM printed on stderr so far.
    pub fn stderr(&self) -> String {
        let o = self.stderr.0.lock().unwrap();
        String::from_utf8_lossy(&o.bytes).to_string()
    }

    /// Waits until `pat` appears on the console after the cursor; moves the
    /// cursor past it and returns the text before it. On a timeout the
    /// test fails saying how long it waited and where the guest was.
    pub fn wait_for(&mut self, pat: &str, timeout: Duration) -> String {
        let start = Instant::now();
        let deadline = start + timeout;
        let (m, cv) = &*self.stdout;
        let mut o = m.lock().unwrap();
        loop {
            let text = String::from_utf8_lossy(&o.bytes[self.cursor..]).to_string();
            if let Some(at) = text.find(pat) {
                let before = text[..at].to_string();
                self.cursor += text[..at + pat.len()].len();
                return before.replace('\r', "");
            }
            let now = Instant::now();
            if o.closed || now >= deadline {
                let why = if o.closed {
                    "tandem exited"
                } else {
                    "timed out"
                };
                let closed = o.closed;
                drop(o);
                let waited = start.elapsed().as_secs_f64();
                // The console as it was, before the last look adds to it.
                let where_ = self.where_is_the_guest();
                let init_said = self.init_said();
                let last_look = if closed {
                    String::new()
                } else {
                    self.last_look()
                };
                panic!(
                    "{why} after {waited:.0} s (limit {} s) waiting for {pat:?}; {init_said}{where_}{last_look}",
                    timeout.as_secs(),
                );
            }
            o = cv.wait_timeout(o, deadline - now).unwrap().0;
        }
    }

    /// For a failure message: what tandem-init said on the console besides
    /// its ready line (a console shell that ended, and how), however far
    /// back in the console it is.
    fn init_said(&self) -> String {
        let lines: Vec<String> = self
            .console()
            .lines()
            .filter(|l| l.starts_with("tandem-guest:") && !l.contains(READY))
            .map(str::to_string)
            .collect();
        if lines.is_empty() {
            String::new()
        } else {
            format!("tandem-init said: {}; ", lines.join(" / "))
        }
    }

    /// For a failure message, after a wait timed out: what the guest's
    /// kernel logged last and which processes run, if a shell still
    /// answers on the console within [`LAST_LOOK`] (a guest whose shell
    /// was respawned does; its kernel log is off the console, `dmesg -n 1`).
    fn last_look(&mut self) -> String {
        if self.stdin.is_none() {
            return String::new();
        }
        let from = self.stdout.0.lock().unwrap().bytes.len();
        // The marker is computed by the shell: an echoed command never matches.
        self.send("\ndmesg | tail -n 40; ps; echo \"@@look$((6*7))@@\"\n");
        let deadline = Instant::now() + LAST_LOOK;
        let (m, cv) = &*self.stdout;
        let mut o = m.lock().unwrap();
        loop {
            let text = String::from_utf8_lossy(&o.bytes[from..]).replace('\r', "");
            if let Some(at) = text.find("@@look42@@") {
                return format!(
                    "\n--- the guest's last look (dmesg, ps) ---\n{}",
                    &text[..at]
                );
            }
            let now = Instant::now();
            if o.closed || now >= deadline {
                return format!(
                    "\n--- no shell answered in {} s after the timeout ---",
                    LAST_LOOK.as_secs()
                );
            }
            o = cv.wait_timeout(o, deadline - now).unwrap().0;
        }
    }

    /// Where the guest was, for a failure message: the VMM's state, the
    /// console's last line and tail, and the VMM's stderr.
    pub fn where_is_the_guest(&mut self) -> String {
        let vmm = match self.child.try_wait() {
            Ok(Some(st)) => format!("tandem has exited ({st})"),
            Ok(None) => format!("tandem (pid {}) is still running", self.child.id()),
            Err(e) => format!("tandem's state is unknown ({e})"),
        };
        let console = self.console();
        let last = console
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("(nothing yet)");
        format!(
            "{vmm}; the console's last line: {last:?}\n--- console ---\n{}\n--- stderr ---\n{}",
            tail(&console, 3000),
            self.stderr()
        )
    }

    /// Writes raw bytes to the console.
    pub fn send(&mut self, s: &str) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        stdin.write_all(s.as_bytes()).expect("write to tandem");
        stdin.flush().expect("flush to tandem");
    }

    /// Numbers this console's next commands from `n` on: for a VM whose
    /// guest went on from another's state (a COLO secondary), whose
    /// markers are in its output already.
    pub fn number_from(&mut self, n: u32) {
        self.seq = n;
    }

    /// Runs a shell command in the guest and returns its output (trimmed)
    /// and exit status.
    pub fn run(&mut self, cmd: &str, timeout: Duration) -> (String, i32) {
        self.seq += 1;
        // The marker is computed by the shell, so an echoed command line
        // never matches it.
        let n = self.seq;
        // `cmd &; echo` is a syntax error: a background job is followed by `true`.
        let sep = if cmd.trim_end().ends_with('&') {
            " true;"
        } else {
            ";"
        };
        self.send(&format!("{cmd}{sep} echo \"@@$(({n}))@@ $?\"\n"));
        let before = self.wait_for(&format!("@@{n}@@ "), timeout);
        let status_text = self.wait_for("\n", CMD_TIMEOUT);
        let status = status_text.trim().parse().unwrap_or(-1);
        // Drop the prompt the shell printed before reading the command, and
        // any notice of a background job that ended printed before it.
        (strip_prompt(&before).trim().to_string(), status)
    }

    /// Runs a command that must succeed, returning its output.
    pub fn ok(&mut self, cmd: &str, timeout: Duration) -> String {
        let (out, status) = self.run(cmd, timeout);
        assert_eq!(status, 0, "`{cmd}` failed with {status}: {out}");
        out
    }

    /// Kills tandem (SIGKILL) and reaps it.
    /// Starts `tandem-dirty MIB RATE` in the guest as a shell job, its
    /// output in /tmp/dirty.out, and waits until it has touched its memory
    /// (each first touch is a page fault in the emulated guest kernel
    /// here: some 30 s for 32 MiB); returns its "ready" line.
    pub fn start_dirty(&mut self, mib: u32, rate: u32) -> String {
        self.ok(
            &format!("tandem-dirty {mib} {rate} > /tmp/dirty.out &"),
            CMD_TIMEOUT,
        );
        let t = Instant::now();
        loop {
            let line = self.ok("read l < /tmp/dirty.out; echo $l", CMD_TIMEOUT);
            if line.contains("ready") {
                return line;
            }
            assert!(t.elapsed() < 3 * CMD_TIMEOUT, "tandem-dirty set up in time");
            std::thread::sleep(Duration::from_secs(1));
        }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Closes stdin (EOF on the console).
    pub fn close_stdin(&mut self) {
        self.stdin.take();
    }

    /// Waits for tandem to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().expect("wait for tandem") {
                // Let the collectors drain what is left.
                for s in [&self.stdout, &self.stderr] {
                    let (m, cv) = &**s;
                    let mut o = m.lock().unwrap();
                    let until = Instant::now() + Duration::from_secs(5);
                    while !o.closed && Instant::now() < until {
                        o = cv.wait_timeout(o, Duration::from_millis(100)).unwrap().0;
                    }
                }
                return st;
            }
            if start.elapsed() >= timeout {
                panic!(
                    "tandem did not exit in {:.0} s (limit {} s); {}",
                    start.elapsed().as_secs_f64(),
                    timeout.as_secs(),
                    self.where_is_the_guest()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for TestVm {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // A failed test: what this VM's guest and VMM said last.
            eprintln!(
                "--- VMM pid {}: console (last 1500 bytes):\n{}\n--- its stderr (last 1500 bytes):\n{}\n---",
                self.child.id(),
                tail(&self.console(), 1500),
                tail(&self.stderr(), 1500)
            );
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        for f in &self.scratch {
            let _ = std::fs::remove_file(f);
        }
        if let Some(p) = self.api_sock.take() {
            let mut socks = api_socks().lock().unwrap_or_else(|e| e.into_inner());
            let n = socks.entry(p.clone()).or_insert(1);
            *n -= 1;
            if *n == 0 {
                socks.remove(&p);
                let _ = std::fs::remove_file(&p);
            }
        }
    }
}

/// Words no line of a clean boot's kernel log has.
pub const FAULT_WORDS: [&str; 5] = ["Error", "Fatal", "BUG", "WARNING", "Call Trace"];

/// The lines of a kernel log printed with `dmesg -r` (each `<N>` first,
/// N = facility * 8 + level) that are at level err (3) or worse, or name
/// one of [`FAULT_WORDS`].
pub fn fault_lines(log: &str) -> Vec<String> {
    log.lines()
        .filter(|l| {
            let level = l
                .strip_prefix('<')
                .and_then(|r| r.split_once('>'))
                .and_then(|(n, _)| n.parse::<u32>().ok())
                .map(|n| n & 7);
            matches!(level, Some(0..=3)) || FAULT_WORDS.iter().any(|w| l.contains(w))
        })
        .map(str::to_string)
        .collect()
}

/// The last `n` bytes of `s` (on a char boundary).
/// Says how far a long test got, and when (seconds since its first call;
/// the phases' times go to the log).
pub fn phase(what: &str) {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let t = START.get_or_init(Instant::now).elapsed();
    eprintln!("[{:6.1} s] {what}", t.as_secs_f64());
}

pub fn tail(s: &str, n: usize) -> &str {
    let mut start = s.len().saturating_sub(n);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}

/// This test process's scratch directory, `/tmp/tandem-TAG-PID` (made at
/// the first call; later calls give the same one, whatever their tag): it
/// and everything in it are removed when the process exits, the tests
/// passed or not.
pub fn process_scratch(tag: &str) -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("tandem-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("make the scratch directory");
        extern "C" fn remove() {
            if let Some(dir) = DIR.get() {
                let _ = std::fs::remove_dir_all(dir);
            }
        }
        // SAFETY: `remove` is a plain function that only reads a static
        // already set; registering it has no other effect.
        unsafe { libc::atexit(remove) };
        dir
    })
    .clone()
}

/// `tandem ctl migrate TO --json OPTS` in `ns`, run: exit status and
/// report.
pub fn migrate(ns: &netns::NetNs, api: &Path, to: &str, opts: &[&str]) -> (i32, serde_json::Value) {
    let out = migrate_cmd(ns, api, to, opts)
        .output()
        .expect("tandem ctl migrate");
    let report = serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
    (out.status.code().unwrap_or(-1), report)
}

/// `tandem ctl migrate TO --json OPTS` in `ns`, its stdout piped, not
/// started.
pub fn migrate_cmd(ns: &netns::NetNs, api: &Path, to: &str, opts: &[&str]) -> Command {
    let mut c = ns.command(tandem_bin().to_str().unwrap());
    c.args([
        "ctl",
        "--api-sock",
        api.to_str().unwrap(),
        "migrate",
        to,
        "--json",
    ])
    .args(opts)
    .stdout(Stdio::piped());
    c
}

/// Runs `tandem <args>` to completion (for commands that fail fast).
pub fn tandem_output(args: &[&str]) -> std::process::Output {
    Command::new(tandem_bin())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run tandem")
}

/// `tandem ctl --api-sock SOCK <verb...>`: its exit code and JSON answer
/// (`Null` when it printed none).
pub fn ctl(sock: &Path, verb: &[&str]) -> (i32, serde_json::Value) {
    let out = Command::new(tandem_bin())
        .arg("ctl")
        .arg("--api-sock")
        .arg(sock)
        .args(verb)
        .output()
        .expect("run tandem ctl");
    let text = String::from_utf8_lossy(&out.stdout);
    let answer = serde_json::from_str(&text).unwrap_or(serde_json::Value::Null);
    (out.status.code().unwrap_or(-1), answer)
}

/// `len` reproducible pseudo-random bytes (xorshift from `seed`, non-zero):
/// incompressible enough for transfer tests.
pub fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Lower-case hex of `d` (e.g. a sha256 digest).
pub fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// The JSON that `tandem run --metrics PATH` wrote.
pub fn read_metrics(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).expect("metrics file");
    serde_json::from_str(&text).expect("metrics JSON")
}

/// What a command printed, without what the shell printed before it: its
/// prompt, and the notices of background jobs that ended (busybox ash
/// prints `[3]+  Done   nc -l ...` before the next prompt).
fn strip_prompt(before: &str) -> &str {
    let mut out = before.trim_start();
    loop {
        if let Some(rest) = out.strip_prefix("~ # ") {
            out = rest.trim_start();
        } else if is_job_notice(out.lines().next().unwrap_or("")) {
            out = out
                .split_once('\n')
                .map_or("", |(_, rest)| rest)
                .trim_start();
        } else {
            return out;
        }
    }
}

/// `[N]+  Done ...`, `[N]- Exit 1 ...`, `[N]   Killed ...` and the like.
fn is_job_notice(line: &str) -> bool {
    let Some(rest) = line.strip_prefix('[') else {
        return false;
    };
    let Some((n, rest)) = rest.split_once(']') else {
        return false;
    };
    let rest = rest.trim_start_matches(['+', '-']).trim_start();
    !n.is_empty()
        && n.bytes().all(|b| b.is_ascii_digit())
        && [
            "Done",
            "Exit",
            "Killed",
            "Terminated",
            "Stopped",
            "Hangup",
            "Interrupt",
        ]
        .iter()
        .any(|w| rest.starts_with(w))
}

#[cfg(test)]
mod prompt_tests {
    use super::strip_prompt;

    #[test]
    fn prompts_and_job_notices_are_dropped() {
        assert_eq!(strip_prompt("~ # abc"), "abc");
        assert_eq!(
            strip_prompt("[3]+  Done                       nc -l -p 5002 0</dev/null 1>/tmp/in5002\n~ # 68ea  /mnt/one"),
            "68ea  /mnt/one"
        );
        assert_eq!(strip_prompt("~ # [1]-  Exit 1   false\nx"), "x");
        assert_eq!(strip_prompt("[a] b"), "[a] b");
        assert_eq!(strip_prompt("[2] 1234"), "[2] 1234");
    }
}

#[cfg(test)]
mod fault_tests {
    use super::fault_lines;

    #[test]
    fn error_levels_and_fault_words_are_found() {
        // Lines of the legacy machine's boot before the fix, and their
        // neighbours.
        let log = "<6>ACPI: Early table checksum verification disabled\n\
                   <3>ACPI BIOS Error (bug): A valid RSDP was not found (20220331/tbxfroot-210)\n\
                   <5>Unknown kernel command line parameters \"noxsave\", will be passed to user space.\n\
                   <4>ACPI Warning: Could not enable fixed event - GlobalLock (1)\n\
                   <4>------------[ cut here ]------------\n\
                   <4>WARNING: CPU: 0 PID: 1 at kernel/x.c:1 f+0x1/0x2\n\
                   <4>Call Trace:\n\
                   <6>PCI: System does not support PCI\n\
                   <11>kernel: a level-3 line of facility 1\n\
                   no prefix, no fault";
        assert_eq!(
            fault_lines(log),
            [
                "<3>ACPI BIOS Error (bug): A valid RSDP was not found (20220331/tbxfroot-210)",
                "<4>WARNING: CPU: 0 PID: 1 at kernel/x.c:1 f+0x1/0x2",
                "<4>Call Trace:",
                "<11>kernel: a level-3 line of facility 1",
            ]
        );
    }
}
