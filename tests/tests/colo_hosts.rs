//! A COLO pair on two simulated hosts with an etcd lease as arbiter, on a
//! real guest (the run's base snapshot, restored; no boot): the primary in
//! namespace "host A", the secondary in "host B", the replication stream on
//! their own link, the client in a third namespace on a LAN both hosts'
//! guests reach, etcd in a fourth, reached by each host over its own link
//! ([`tandem_tests::hosts`]). Each test cuts links one by one while a
//! client's TCP stream runs through the pair, and checks its bytes.
//!
//! - etcd killed: the pair goes on protected (checkpoints go on; the
//!   primary's lease cannot be renewed, but the secondary answers); etcd
//!   back, the primary renews the same lease. Then host A is cut off from
//!   etcd and from B (its LAN stays): A fences itself (state `fenced`)
//!   before B takes over, B takes over only after the lease's TTL, and the
//!   client receives no frame from A from the moment B serves; the stream
//!   arrives whole at B. Links restored, A learns that it lost and ends
//!   (status 1, one line saying who holds the lease).
//!   The pair's streams run over TLS, each host with its own certificate.
//! - only the replication link cut (plain TCP, `--insecure`): A holds the lease and goes on alone;
//!   B waits for the lease past the TTL and never serves (the client
//!   receives nothing from B's host, before or after the link is back);
//!   the stream arrives whole at A.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use tandem_tests::base::{device_args, disk_copy, scratch, BASE_MEM};
use tandem_tests::colo::{status, wait_checkpoints, wait_until};
use tandem_tests::hosts::{Hosts, Link, REP_A, REP_B};
use tandem_tests::pki::Pki;
use tandem_tests::stream::{Pace, Stream};
use tandem_tests::{ctl, phase, tandem_bin, TestVm};

const CMD: Duration = tandem_tests::CMD_TIMEOUT;
/// The lease's TTL, s (etcd's minimum).
const TTL_S: u64 = 2;
/// The client's stream: 4 MiB, 16 KiB every 200 ms (some 52 s).
const THROUGH: Pace = Pace {
    bytes: 4 << 20,
    piece: 16 << 10,
    every: Duration::from_millis(200),
};

/// A pair across hosts A and B, protected, with a client stream running.
struct Pair {
    hosts: Hosts,
    primary: TestVm,
    primary_api: PathBuf,
    secondary: TestVm,
    secondary_api: PathBuf,
    stream: Option<Stream>,
    /// Host A's and host B's certificates (one CA), with TLS.
    _pki: Option<(Pki, Pki)>,
}

impl Pair {
    /// With `tls`, each host has its own certificate (B's naming its
    /// replication address) and the pair's streams are TLS; without,
    /// they are plain TCP, which needs `--insecure` on both.
    fn new(tag: &str, tls: bool) -> Pair {
        let hosts = Hosts::new(tag);
        let pki = tls.then(|| {
            let a = Pki::new(&format!("{tag}-a"), &[REP_A]);
            let b = Pki::signed_by(&a, &format!("{tag}-b"), &[REP_B]);
            (a, b)
        });
        let (a_sec, b_sec) = match &pki {
            Some((a, b)) => (a.args(), b.args()),
            None => (vec!["--insecure".into()], vec!["--insecure".into()]),
        };
        let primary_api = scratch(&format!("{tag}-p.api"));
        let mut a_args = vec!["--api-sock", primary_api.to_str().unwrap()];
        a_args.extend(a_sec.iter().map(String::as_str));
        let mut primary = TestVm::restore_base(&hosts.a, ["tap0", "tap1"], &a_args);
        let secondary_api = scratch(&format!("{tag}-s.api"));
        let addr = format!("tcp:{REP_B}:7700");
        let image = disk_copy();
        let mut args: Vec<String> = [
            "--colo",
            "secondary",
            "--colo-listen",
            &addr,
            "--colo-arbiter",
            &hosts.arbiter(false, tag),
            "--colo-lease-ttl-s",
            &TTL_S.to_string(),
            "--mem",
            BASE_MEM,
            "--api-sock",
            secondary_api.to_str().unwrap(),
        ]
        .map(String::from)
        .to_vec();
        args.extend(device_args(["tap0", "tap1"], &image));
        args.extend(b_sec);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut secondary =
            TestVm::start_with(hosts.b.command(tandem_bin().to_str().unwrap()), &args);
        secondary.remove_on_drop(image);
        wait_until("the secondary listens", CMD, || {
            secondary.stderr().contains("waiting for a migration on")
        });
        let stream = Stream::start(&mut primary, &hosts.client, 5001, 41, THROUGH);
        let (code, a) = ctl(
            &primary_api,
            &[
                "colo-start",
                &addr,
                "--checkpoint-period-ms",
                "2000",
                "--arbiter",
                &hosts.arbiter(true, tag),
                "--lease-ttl-s",
                &TTL_S.to_string(),
            ],
        );
        assert_eq!(code, 0, "colo-start: {a}");
        wait_checkpoints(&primary_api, 1);
        Pair {
            hosts,
            primary,
            primary_api,
            secondary,
            secondary_api,
            stream: Some(stream),
            _pki: pki,
        }
    }

    fn state(&self, primary: bool) -> serde_json::Value {
        status(if primary {
            &self.primary_api
        } else {
            &self.secondary_api
        })
    }
}

#[test]
fn a_host_cut_off_fences_and_the_other_takes_over_after_the_ttl() {
    let mut pair = Pair::new("ch-a", true);
    let s = pair.state(true);
    phase(&format!("hosts a: protected: {}", s["lease"]));
    assert_eq!(s["lease"]["kind"], "etcd", "{s}");
    assert_eq!(s["transport"], "tls", "{s}");
    assert_eq!(pair.state(false)["transport"], "tls");
    assert_eq!(s["lease"]["held"], true, "{s}");
    assert!(
        s["lease"]["holder"]
            .as_str()
            .is_some_and(|h| h.contains("primary")),
        "{s}"
    );
    assert!(
        s["lease"]["ttl_left_ms"]
            .as_u64()
            .is_some_and(|t| t <= TTL_S * 1000),
        "{s}"
    );

    // etcd dies: the primary cannot renew, but the pair goes on protected.
    pair.hosts.kill_etcd();
    let before = s["checkpoints"]["total"].as_u64().unwrap_or(0);
    std::thread::sleep(Duration::from_secs(2 * TTL_S + 1));
    let s = pair.state(true);
    phase(&format!(
        "hosts a: etcd dead for {} s: {}",
        2 * TTL_S + 1,
        s["lease"]
    ));
    assert_eq!(s["state"], "protected", "{s}");
    assert_eq!(s["lease"]["held"], false, "not renewable: {s}");
    assert!(
        s["checkpoints"]["total"].as_u64() >= Some(before + 2),
        "checkpoints go on: {s}"
    );
    assert_eq!(pair.state(false)["state"], "protected");
    // etcd back: the same lease, renewed.
    pair.hosts.start_etcd();
    wait_until("the primary renews its lease", CMD, || {
        pair.state(true)["lease"]["held"] == true
    });
    phase("hosts a: etcd back, the lease renewed");

    let stream = pair.stream.take().expect("the stream");
    assert!(stream.running(), "the stream runs across the failover");
    pair.hosts.cut(Link::Replication);
    pair.hosts.cut(Link::EtcdA);
    let cut = Instant::now();
    let (mut fenced, mut over) = (None, None);
    let mut from_a_at_takeover = 0;
    wait_until("A fenced and B serving", CMD, || {
        if fenced.is_none() && pair.state(true)["state"] == "fenced" {
            fenced = Some(cut.elapsed());
        }
        if over.is_none() && pair.state(false)["state"] == "failed_over" {
            over = Some(cut.elapsed());
            from_a_at_takeover = pair.hosts.from_host(true);
        }
        fenced.is_some() && over.is_some()
    });
    let (fenced, over) = (fenced.unwrap(), over.unwrap());
    phase(&format!(
        "hosts a: A fenced {} ms after the cut, B took over {} ms after it (TTL {TTL_S} s)",
        fenced.as_millis(),
        over.as_millis()
    ));
    assert!(
        fenced < over,
        "A fenced ({fenced:?}) before B served ({over:?})"
    );
    // A's lease was renewed at most a sixth of the TTL before the cut.
    let floor = Duration::from_millis(TTL_S * 1000 * 5 / 6 - 100);
    assert!(over >= floor, "B took over only after the TTL: {over:?}");
    assert!(pair.primary.stderr().contains("tandem: COLO: fenced"));
    assert!(pair.secondary.stderr().contains("tandem: COLO: failover"));

    stream.check(&mut pair.secondary);
    assert_eq!(
        pair.hosts.from_host(true),
        from_a_at_takeover,
        "no frame from host A reached the client once B served"
    );
    phase("hosts a: the stream arrived whole at B; nothing from A since");

    for link in [Link::Replication, Link::EtcdA] {
        pair.hosts.restore(link);
    }
    let st = pair.primary.wait_exit(CMD);
    let err = pair.primary.stderr();
    assert_eq!(st.code(), Some(1), "the fenced side ends: {err}");
    assert!(
        err.contains("lost the lease") && err.contains("secondary pid"),
        "one line saying who holds the lease: {err}"
    );
    assert_eq!(
        pair.hosts.from_host(true),
        from_a_at_takeover,
        "nothing from host A after the links came back"
    );
    let s = pair.state(false);
    assert_eq!(s["state"], "failed_over", "{s}");
    assert_eq!(s["lease"]["held"], true, "{s}");
    pair.secondary.ok("true", CMD);
    phase("hosts a: links restored: A knew it lost and ended; B serves");
}

#[test]
fn a_cut_replication_link_leaves_the_lease_holder_serving_alone() {
    let mut pair = Pair::new("ch-b", false);
    assert_eq!(pair.state(true)["transport"], "plain");
    let from_b = pair.hosts.from_host(false);
    let stream = pair.stream.take().expect("the stream");
    pair.hosts.cut(Link::Replication);
    let cut = Instant::now();
    wait_until("A goes on alone", CMD, || {
        pair.state(true)["state"] == "primary_alone"
    });
    wait_until("B waits for the lease", CMD, || {
        pair.state(false)["state"] == "failing_over"
    });
    let ttl = Duration::from_secs(TTL_S);
    std::thread::sleep((ttl * 2 + Duration::from_secs(1)).saturating_sub(cut.elapsed()));
    let s = pair.state(false);
    phase(&format!(
        "hosts b: 2 TTLs after the cut, B: {}",
        s["reason"]
    ));
    assert_eq!(s["state"], "failing_over", "B does not serve: {s}");
    assert_eq!(pair.state(true)["lease"]["held"], true);
    assert!(stream.running(), "the stream runs across the cut");
    stream.check(&mut pair.primary);
    phase("hosts b: the stream arrived whole at A");
    pair.hosts.restore(Link::Replication);
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(pair.state(false)["state"], "failing_over");
    assert_eq!(
        pair.hosts.from_host(false),
        from_b,
        "nothing from host B reached the client from the cut on"
    );
    pair.primary.ok("true", CMD);
    assert!(pair.primary.stderr().contains("runs on here alone"));
}
