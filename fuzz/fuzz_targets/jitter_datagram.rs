//! Datagrams from a guest's `tandem-jitter` into the migration probe's gap
//! collector (`vmm::cli::probe::gaps`): the fuzz input is split into datagrams
//! at newlines (one line each, as the tool sends them), each taken at a
//! growing arrival time; then the gaps are sorted and summarized. Refused
//! or counted, never a panic, an unbounded allocation or a gap counted
//! twice.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmm::cli::probe::gaps::GapLog;

fuzz_target!(|data: &[u8]| {
    let mut log = GapLog::default();
    let mut taken = 0u64;
    for (i, datagram) in data.split(|&b| b == b'\n').enumerate() {
        log.take(datagram, i as f64 * 100.0);
        taken += 1;
    }
    log.done();
    assert_eq!(
        log.reports + log.bad,
        taken,
        "every datagram is counted once"
    );
    let mut ids: Vec<u64> = log.gaps.iter().map(|g| g.id).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), log.gaps.len(), "a gap is kept once");
    assert!(log.gaps.windows(2).all(|w| w[0].t_ms <= w[1].t_ms));
    let data = vmm::cli::probe::ProbeData {
        gaps: log.gaps,
        ..Default::default()
    };
    let s = vmm::cli::probe::summarize(&data, (0.0, 1e9));
    assert!(s.during.largest_gaps_ms.len() <= vmm::cli::probe::summary::LARGEST);
});
