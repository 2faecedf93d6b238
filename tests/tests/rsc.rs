//! Receive segment coalescing with a real Linux guest: one guest (the run's
//! base snapshot, restored), two NICs on taps in a network namespace the
//! test creates, eth0 with `rsc=off` and eth1 with `rsc=on` (as the base
//! has them). The same 2 MiB TCP stream goes host -> guest through
//! each; the guest's sha256 must equal the host's on both, the rsc=on NIC
//! must have coalesced (fewer packets to the guest than frames read from the
//! tap) and the rsc=off NIC must show no RSC at all; neither may drop.
//!
//! The guest negotiates GUEST_TSO4, so the tap would hand over the host
//! sender's 64 KiB TSO packets whole (the engine passes them as
//! `already_gso`: nothing to coalesce). The test turns segmentation offload
//! off on both taps (`ethtool -K tapN tso off gso off`, as in the seed's
//! "tso/gso/gro off" measurement) so that the host's TCP sends MSS-sized
//! segments, which is what a tap sees from a real wire, and checks that no
//! GSO frame came in.

use std::io::Write;
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use tandem_tests::base::{GUEST_IP0, GUEST_IP1, HOST_IP0, HOST_IP1, PREFIX};
use tandem_tests::netns::NetNs;
use tandem_tests::{hex, TestVm};

const CMD: Duration = tandem_tests::CMD_TIMEOUT;
const XFER: Duration = tandem_tests::budget(Duration::from_secs(300));
const LEN: usize = 2 << 20;
/// Most frames the receive path may hold for a guest without buffers
/// (`devices::virtio::net::rx_pump::MAX_HELD`).
const MAX_HELD: u64 = 2 * 32 + 2;
/// The base's NICs by `--net` index (= the metrics' `net` index).
const RSC_OFF: usize = 0;
const RSC_ON: usize = 1;

fn data(len: usize) -> Vec<u8> {
    tandem_tests::pseudo_random(len, 0x2545_f491_4f6c_dd1d)
}

fn metrics(path: &std::path::Path) -> serde_json::Value {
    tandem_tests::read_metrics(path)
}

fn run(mut cmd: Command) -> String {
    let out = cmd.output().expect("run a host command");
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// Turns TSO and GSO off on `tap` and checks that they are off.
fn segmentation_off(ns: &NetNs, tap: &str) {
    let mut c = ns.command("ethtool");
    c.args(["-K", tap, "tso", "off", "gso", "off"]);
    run(c);
    let mut c = ns.command("ethtool");
    c.args(["-k", tap]);
    let k = run(c);
    for feature in [
        "tcp-segmentation-offload: off",
        "generic-segmentation-offload: off",
    ] {
        assert!(k.contains(feature), "{tap}: {feature} expected:\n{k}");
    }
}

/// Sends `blob` to `addr` from inside the namespace; returns the seconds
/// from connect to the guest's end of the transfer (`wait` returned).
fn send(ns: &NetNs, vm: &mut TestVm, addr: &'static str, port: u16, blob: &[u8]) -> f64 {
    vm.ok(&format!("nc -l -p {port} </dev/null >/tmp/in{port} &"), CMD);
    let start = Instant::now();
    let sender = {
        let blob = blob.to_vec();
        ns.spawn(move || {
            let deadline = Instant::now() + tandem_tests::budget(Duration::from_secs(30));
            let mut s = loop {
                match TcpStream::connect((addr, port)) {
                    Ok(s) => break s,
                    Err(e) if Instant::now() < deadline => {
                        let _ = e;
                        std::thread::sleep(Duration::from_millis(500));
                    }
                    Err(e) => panic!("connect to guest {addr}: {e}"),
                }
            };
            s.write_all(&blob).expect("send to guest");
        })
    };
    sender.join().expect("sender");
    vm.ok("wait", XFER);
    let secs = start.elapsed().as_secs_f64();
    // The shell may first report the finished background job: take the sum.
    let got = vm.ok(&format!("sha256sum /tmp/in{port}"), CMD);
    let sum = got
        .split_whitespace()
        .find(|t| t.len() == 64 && t.chars().all(|c| c.is_ascii_hexdigit()));
    let want = hex(&Sha256::digest(blob));
    assert_eq!(
        sum,
        Some(want.as_str()),
        "{addr}: bytes in the guest: {got}"
    );
    vm.ok(&format!("rm /tmp/in{port}"), CMD);
    secs
}

#[test]
fn rsc_on_coalesces_rsc_off_does_not_and_both_deliver_every_byte() {
    let ns = NetNs::new("rsc");
    ns.add_tap("tap0", &format!("{HOST_IP0}/{PREFIX}"));
    ns.add_tap("tap1", &format!("{HOST_IP1}/{PREFIX}"));
    let metrics_path = std::env::temp_dir().join(format!("tandem-rsc-{}.json", std::process::id()));
    let mut vm = TestVm::restore_base(
        &ns,
        ["tap0", "tap1"],
        &["--metrics", metrics_path.to_str().unwrap()],
    );
    // The restored devices run (tap offloads set): now turn host-side
    // segmentation off.
    segmentation_off(&ns, "tap0");
    segmentation_off(&ns, "tap1");

    let blob = data(LEN);
    let on = send(&ns, &mut vm, GUEST_IP1, 5001, &blob);
    let off = send(&ns, &mut vm, GUEST_IP0, 5002, &blob);
    let mbit = |s: f64| LEN as f64 * 8.0 / 1e6 / s;
    eprintln!(
        "2 MiB host->guest: rsc=on {on:.1} s ({:.2} Mbit/s), rsc=off {off:.1} s ({:.2} Mbit/s)",
        mbit(on),
        mbit(off)
    );

    // Wait for a metrics write after the transfers.
    std::thread::sleep(Duration::from_secs(2));
    let m = metrics(&metrics_path);
    eprintln!("{m}");
    for nic in 0..2 {
        let c = &m["net"][nic]["counters"];
        assert_eq!(c["drops"], 0, "NIC {nic}: {m}");
        assert_eq!(c["malformed_chains"], 0, "NIC {nic}: {m}");
        assert!(
            c["rx_bytes"].as_u64().unwrap() >= LEN as u64,
            "NIC {nic}: {m}"
        );
    }

    // eth1, rsc=on: segments came in one by one and left coalesced.
    let c = &m["net"][RSC_ON]["counters"];
    let rsc = &m["net"][RSC_ON]["rsc"];
    let read = rsc["received"].as_u64().unwrap();
    let to_guest = c["rx_packets"].as_u64().unwrap();
    assert!(
        read >= (LEN / 1460) as u64,
        "MSS-sized segments read from tap1: {m}"
    );
    assert_eq!(
        rsc["pass"]["already_gso"], 0,
        "tap1 handed over GSO frames: segmentation offload still on? {m}"
    );
    assert!(rsc["coalesced"].as_u64().unwrap() > 0, "{m}");
    assert!(rsc["coalesced_frames"].as_u64().unwrap() > 0, "{m}");
    assert!(
        to_guest < read,
        "fewer packets to the guest ({to_guest}) than frames from the tap ({read}): {m}"
    );
    assert_eq!(
        rsc["delivered"].as_u64().unwrap(),
        to_guest,
        "every frame out of the engine reached the guest: {m}"
    );
    assert!(c["rx_held_max"].as_u64().unwrap() <= MAX_HELD, "{m}");

    // eth0, rsc=off: no engine, one packet per frame read, never more than
    // one frame held.
    assert!(m["net"][RSC_OFF]["rsc"].is_null(), "{m}");
    let c1 = &m["net"][RSC_OFF]["counters"];
    assert!(
        c1["rx_packets"].as_u64().unwrap() >= (LEN / 1460) as u64,
        "{m}"
    );
    assert!(c1["rx_held_max"].as_u64().unwrap() <= 1, "{m}");

    vm.send("reboot -f\n");
    let st = vm.wait_exit(tandem_tests::budget(Duration::from_secs(40)));
    assert_eq!(st.code(), Some(0));
    let _ = std::fs::remove_file(&metrics_path);
}
