//! virtio-net on real taps in network namespaces the test creates: ping
//! both ways, 4 MiB TCP each way with sha256 checked on both ends, two NICs
//! at once, the device counters, and a 30 s UDP flood from the guest into a
//! rate-limited path, where the tap fills up and the device must throttle
//! the guest (TX waits, no drops, no memory growth) while the console and
//! the other NIC stay responsive.
//!
//! The guest is the run's base snapshot, restored (`tandem_tests::base`:
//! eth0 192.0.2.2/24 `rsc=off`, eth1 198.51.100.2/24 `rsc=on`).
//! Topology: namespace A holds tap0 (192.0.2.1/24, the host side of eth0)
//! and tap1, which is wired (tc mirred) to a veth whose egress is limited by
//! `tbf` to 200 kbit/s; its peer is in namespace B with 198.51.100.1/24, the
//! far end of eth1. tandem runs in A with `sndbuf=64K` on tap1.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use tandem_tests::base::{GUEST_IP0, GUEST_IP1, HOST_IP0, HOST_IP1, MAC0, MAC1, PREFIX};
use tandem_tests::netns::NetNs;
use tandem_tests::{hex, TestVm};

const CMD: Duration = tandem_tests::CMD_TIMEOUT;
const XFER: Duration = tandem_tests::budget(Duration::from_secs(300));
/// The TCP transfers' size, each way.
const XFER_BYTES: usize = 4 << 20;

fn data(len: usize) -> Vec<u8> {
    tandem_tests::pseudo_random(len, 0x9e37_79b9_7f4a_7c15)
}

fn metrics(path: &std::path::Path) -> serde_json::Value {
    tandem_tests::read_metrics(path)
}

#[test]
fn two_nics_ping_and_tcp_both_ways() {
    let ns = NetNs::new("net");
    let far = NetNs::new("netb");
    ns.add_tap("tap0", &format!("{HOST_IP0}/{PREFIX}"));
    ns.add_bare_tap("tap1");
    ns.add_veth("veth0", &far, "veth1", &format!("{HOST_IP1}/{PREFIX}"));
    ns.must(
        "tc",
        &[
            "qdisc", "add", "dev", "veth0", "root", "tbf", "rate", "200kbit", "burst", "4kb",
            "limit", "1mb",
        ],
    );
    ns.wire("tap1", "veth0");
    let metrics_path = std::env::temp_dir().join(format!("tandem-net-{}.json", std::process::id()));
    let mut vm = TestVm::restore_base(
        &ns,
        ["tap0", "tap1,sndbuf=64K"],
        &["--metrics", metrics_path.to_str().unwrap()],
    );

    // Two NICs with the MACs the base asked for.
    assert_eq!(vm.ok("cat /sys/class/net/eth0/address", CMD), MAC0);
    assert_eq!(vm.ok("cat /sys/class/net/eth1/address", CMD), MAC1);

    // Ping both ways, on both NICs.
    vm.ok(&format!("ping -c 2 -W 20 {HOST_IP0}"), CMD);
    vm.ok(&format!("ping -c 2 -W 20 {HOST_IP1}"), CMD);
    for (from, addr) in [(&ns, GUEST_IP0), (&far, GUEST_IP1)] {
        let out = from
            .command("ping")
            .args(["-c", "2", "-W", "20", addr])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "host ping {addr}: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }

    // TCP host -> guest, 4 MiB (some 2900 segments: the queues wrap many
    // times).
    let blob = data(XFER_BYTES);
    let want = hex(&Sha256::digest(&blob));
    vm.ok("nc -l -p 5001 </dev/null >/tmp/in &", CMD);
    let sender = {
        let blob = blob.clone();
        ns.spawn(move || {
            let deadline = Instant::now() + tandem_tests::budget(Duration::from_secs(30));
            let mut s = loop {
                match TcpStream::connect((GUEST_IP0, 5001)) {
                    Ok(s) => break s,
                    Err(e) if Instant::now() < deadline => {
                        let _ = e;
                        std::thread::sleep(Duration::from_millis(500));
                    }
                    Err(e) => panic!("connect to guest: {e}"),
                }
            };
            s.write_all(&blob).expect("send to guest");
        })
    };
    sender.join().expect("sender");
    vm.ok("wait", XFER);
    // The shell may first report the finished background job: take the sum.
    let got = vm.ok("sha256sum /tmp/in", CMD);
    let sum = got
        .split_whitespace()
        .find(|t| t.len() == 64 && t.chars().all(|c| c.is_ascii_hexdigit()));
    assert_eq!(sum, Some(want.as_str()), "host->guest bytes: {got}");

    // TCP guest -> host, the same 4 MiB back.
    let listener = ns.spawn(|| {
        let l = TcpListener::bind((HOST_IP0, 5002)).expect("bind");
        let (mut c, _) = l.accept().expect("accept");
        let mut got = Vec::new();
        c.read_to_end(&mut got).expect("receive from guest");
        got
    });
    std::thread::sleep(Duration::from_millis(500));
    vm.ok(&format!("nc {HOST_IP0} 5002 </tmp/in >/dev/null"), XFER);
    let back = listener.join().expect("listener");
    assert_eq!(back.len(), blob.len(), "guest->host length");
    assert_eq!(hex(&Sha256::digest(&back)), want, "guest->host bytes");

    udp_flood(&mut vm, &ns, &far, &metrics_path);

    // Wait for a metrics write after the transfers.
    std::thread::sleep(Duration::from_secs(2));
    let m = metrics(&metrics_path);
    let eth0 = &m["net"][0]["counters"];
    assert_eq!(eth0["drops"], 0, "{m}");
    assert_eq!(eth0["malformed_chains"], 0, "{m}");
    let xfer = XFER_BYTES as u64;
    assert!(eth0["rx_bytes"].as_u64().unwrap() >= xfer, "{m}");
    assert!(eth0["tx_bytes"].as_u64().unwrap() >= xfer, "{m}");
    assert!(
        m["net"][1]["counters"]["rx_packets"].as_u64().unwrap() > 0,
        "{m}"
    );

    vm.send("reboot -f\n");
    let st = vm.wait_exit(tandem_tests::budget(Duration::from_secs(40)));
    assert_eq!(st.code(), Some(0));

    // Every frame the device took from eth1's TX queue reached tap1: the
    // final counters (written at exit) against the kernel's count of frames
    // written into the tap.
    let m = metrics(&metrics_path);
    let eth1 = &m["net"][1]["counters"];
    let (tap_rx, _) = ns.link_packets("tap1");
    assert_eq!(eth1["tx_packets"].as_u64(), Some(tap_rx), "{m}");
    assert_eq!(eth1["drops"], 0, "{m}");
    let _ = std::fs::remove_file(&metrics_path);
}

/// What the far end of the flood saw.
struct Received {
    packets: u64,
    /// Sequence numbers that went backwards or repeated.
    reordered: u64,
    /// Sequence numbers skipped (lost before reaching the tap: the guest's
    /// own queues drop silently when its driver is throttled).
    skipped: u64,
}

/// Receives the flood in namespace B until it has been quiet for 10 s.
fn receive_flood(far: &NetNs) -> std::thread::JoinHandle<Received> {
    let sock = far
        .spawn(|| UdpSocket::bind((HOST_IP1, 7000)).expect("bind UDP"))
        .join()
        .expect("bind thread");
    std::thread::spawn(move || {
        sock.set_read_timeout(Some(Duration::from_secs(1)))
            .expect("timeout");
        let mut r = Received {
            packets: 0,
            reordered: 0,
            skipped: 0,
        };
        let mut next = 0u64;
        let mut buf = vec![0u8; 2048];
        let (mut quiet, start) = (0, Instant::now());
        loop {
            match sock.recv(&mut buf) {
                Ok(n) if n >= 8 => {
                    quiet = 0;
                    let seq = u64::from_be_bytes(buf[..8].try_into().unwrap());
                    r.packets += 1;
                    if seq < next {
                        r.reordered += 1;
                    } else {
                        r.skipped += seq - next;
                        next = seq + 1;
                    }
                }
                Ok(_) => {}
                Err(_) => {
                    quiet += 1;
                    let waited = start.elapsed() > tandem_tests::budget(Duration::from_secs(120));
                    if (r.packets > 0 && quiet >= 10) || waited {
                        return r;
                    }
                }
            }
        }
    })
}

/// A 30 s UDP flood from the guest out of eth1 into the 200 kbit/s path.
fn udp_flood(vm: &mut TestVm, ns: &NetNs, far: &NetNs, metrics_path: &std::path::Path) {
    const GUEST_KIB: u64 = 128 << 10;
    // The far end's address is pinned in the guest. The flood is one-way
    // UDP behind a ~4 s queue (tap, tbf), so when the guest's neighbour
    // entry ages out mid-flood its ARP probes wait behind the queue and time
    // out; Linux then drops the datagrams parked on the unresolved entry
    // (60 at once, seen twice in CI and reproduced with a 3 s reachable
    // time). That is the guest's ARP, not the device: pinning it leaves
    // every loss the device could cause counted below.
    let mac = far
        .command("cat")
        .arg("/sys/class/net/veth1/address")
        .output()
        .expect("read veth1's MAC");
    let mac = String::from_utf8_lossy(&mac.stdout).trim().to_string();
    vm.ok(&format!("arp -i eth1 -s {HOST_IP1} {mac}"), CMD);
    let before = metrics(metrics_path)["net"][1]["counters"].clone();
    let receiver = receive_flood(far);
    vm.ok(
        &format!("udpflood {HOST_IP1} 7000 30 1400 >/tmp/flood 2>&1 &"),
        CMD,
    );
    let flood_start = Instant::now();
    std::thread::sleep(Duration::from_secs(5));
    let mem_start = vm.vmm_overhead_kib(GUEST_KIB);

    // The console answers while the guest floods.
    let mut slowest = Duration::ZERO;
    for i in 0..3 {
        let t = Instant::now();
        assert_eq!(vm.ok(&format!("echo alive{i}"), CMD), format!("alive{i}"));
        slowest = slowest.max(t.elapsed());
    }
    // The other NIC answers every ping.
    let out = ns
        .command("ping")
        .args(["-c", "5", "-W", "20", GUEST_IP0])
        .output()
        .unwrap();
    let ping = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success() && ping.contains(" 0% packet loss"),
        "eth0 ping during the flood: {ping}"
    );
    let elapsed = flood_start.elapsed();
    assert!(
        elapsed < Duration::from_secs(30),
        "the checks took {elapsed:?}: they must run while the flood does"
    );

    vm.ok("wait", CMD);
    let out = vm.ok("cat /tmp/flood", CMD);
    // The shell may first report the finished job: keep the tool's line.
    let report = out
        .lines()
        .find_map(|l| l.find("udpflood: sent").map(|at| l[at..].to_string()))
        .unwrap_or_else(|| panic!("no report from udpflood: {out}"));
    let sent: u64 = report
        .split_whitespace()
        .nth(2)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("udpflood report: {report}"));
    let mem_end = vm.vmm_overhead_kib(GUEST_KIB);
    let got = receiver.join().expect("receiver");
    std::thread::sleep(Duration::from_secs(2));
    let after = metrics(metrics_path)["net"][1]["counters"].clone();
    let delta = |k: &str| after[k].as_u64().unwrap() - before[k].as_u64().unwrap();
    eprintln!(
        "flood: guest `{report}`; far end got {} packets ({} skipped, {} reordered); \
         device: {} tx packets, {} tap-full waits, {} drops; VMM memory {mem_start} -> {mem_end} KiB; \
         slowest console answer {slowest:?}; eth0 ping: {}",
        got.packets,
        got.skipped,
        got.reordered,
        delta("tx_packets"),
        delta("tap_full_waits"),
        delta("drops"),
        ping.lines().last().unwrap_or("")
    );
    // The tap really filled up and the device waited instead of dropping.
    assert!(delta("tap_full_waits") > 0, "no tap-full waits: {after}");
    assert_eq!(delta("drops"), 0, "{after}");
    assert_eq!(delta("malformed_chains"), 0, "{after}");
    // Throttled, not dropped: everything the guest sent got through the
    // slow path, once and in order.
    assert!(got.packets > 100, "far end got {} packets", got.packets);
    assert_eq!(got.reordered, 0);
    assert_eq!(got.skipped, 0);
    assert_eq!(
        got.packets, sent,
        "guest sent {sent}, far end got {}",
        got.packets
    );
    // Queued frames wait in guest memory, not in the VMM.
    assert!(
        mem_end <= mem_start + 1024,
        "VMM memory grew from {mem_start} to {mem_end} KiB during the flood"
    );
}
