//! The probe's picture: a PNG with the ping round trips above (lost pings
//! marked) and the guest's gaps below (each reported gap, and each
//! datagram's largest gap, the idle floor), on one time axis, with the
//! marks as labelled vertical lines.
//!
//! Run by whoever holds a [`ProbeData`], after the probe finished. Text
//! needs a TrueType font, read at run time from [`FONT`] (Debian's
//! fonts-dejavu-core) and registered with plotters once per process, so
//! nothing is linked against a system font library. Never draws outside
//! its axes: values are clamped into them.

use std::path::Path;
use std::sync::Mutex;

use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;

use super::{ProbeData, ProbeError};

/// The font text is drawn with.
pub const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";
/// The picture's size, pixels.
pub const SIZE: (u32, u32) = (1200, 600);

/// The lowest values the log-scale axes show, ms: round trips, gaps.
const RTT_FLOOR_MS: f64 = 0.01;
const GAP_FLOOR_MS: f64 = 0.1;

const GAP_RED: RGBColor = RGBColor(200, 30, 30);
const REPORT_GREY: RGBColor = RGBColor(140, 140, 140);
const PING_BLUE: RGBColor = RGBColor(30, 80, 200);
const MARK_GREEN: RGBColor = RGBColor(0, 130, 60);

/// Draws `data` as a PNG at `path`.
pub fn plot(data: &ProbeData, path: &Path) -> Result<(), ProbeError> {
    register_font()?;
    let fail = |e: Box<dyn std::error::Error + Send + Sync>| ProbeError::Plot(path.to_owned(), e);
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    let x_max = end_s(data);
    let (top, bottom) = root.split_vertically(SIZE.1 / 2);
    root.fill(&WHITE).map_err(|e| fail(e.into()))?;
    draw_pings(&top, data, x_max).map_err(|e| fail(e.into()))?;
    draw_gaps(&bottom, data, x_max).map_err(|e| fail(e.into()))?;
    root.present().map_err(|e| fail(e.into()))
}

/// Reads [`FONT`] and gives it to plotters as "sans-serif", once.
fn register_font() -> Result<(), ProbeError> {
    static DONE: Mutex<bool> = Mutex::new(false);
    let mut done = devices::sync::lock(&DONE);
    if *done {
        return Ok(());
    }
    let bytes = std::fs::read(FONT).map_err(|e| ProbeError::Font(FONT.into(), e))?;
    // plotters keeps fonts for the life of the process: this buffer is
    // leaked once (the lock makes it once).
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| ProbeError::FontInvalid(FONT.into()))?;
    *done = true;
    Ok(())
}

/// The last instant of the records, s (at least 1).
fn end_s(data: &ProbeData) -> f64 {
    let last = [
        data.pings.last().map(|p| p.t_ms),
        data.gaps.iter().map(|g| g.t_ms).reduce(f64::max),
        data.marks.iter().map(|m| m.t_ms).reduce(f64::max),
        data.guest_max_gap_ms_by_report.last().map(|r| r.0),
    ];
    let ms = last.into_iter().flatten().fold(0.0, f64::max);
    (ms / 1000.0 * 1.02).max(1.0)
}

/// The top of a log axis showing values up to `max` ms.
fn top_ms(max: f64) -> f64 {
    (max * 2.0).max(10.0)
}

type Chart<'a, DB> = ChartContext<'a, DB, Cartesian2d<RangedCoordf64, LogCoord<f64>>>;

/// One panel: time (s) across, a log scale of ms from `floor` to `top` up.
fn panel<'a, DB: DrawingBackend>(
    area: &'a DrawingArea<DB, Shift>,
    caption: &str,
    y_desc: &str,
    x_max: f64,
    (floor, top): (f64, f64),
) -> DrawResult<Chart<'a, DB>, DB> {
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 16))
        .margin(8)
        .margin_right(24)
        .x_label_area_size(34)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..x_max, (floor..top).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("time (s)")
        .y_desc(y_desc)
        .label_style(("sans-serif", 12))
        .x_label_formatter(&|x| tick(*x))
        .y_label_formatter(&|y| tick(*y))
        .draw()?;
    Ok(chart)
}

/// A tick label: no more digits than it needs.
fn tick(v: f64) -> String {
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_owned()
}

fn draw_pings<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    data: &ProbeData,
    x_max: f64,
) -> DrawResult<(), DB> {
    let rtt_max = data
        .pings
        .iter()
        .filter_map(|p| p.rtt_ms)
        .fold(0.0, f64::max);
    let y = (RTT_FLOOR_MS, top_ms(rtt_max));
    let caption = "ping round trip (x: lost)";
    let mut chart = panel(area, caption, "rtt (ms)", x_max, y)?;
    let at = |t_ms: f64, v: f64| ((t_ms / 1000.0).clamp(0.0, x_max), v.clamp(y.0, y.1));
    chart.draw_series(data.pings.iter().filter_map(|p| {
        p.rtt_ms
            .map(|rtt| Circle::new(at(p.t_ms, rtt), 2, PING_BLUE.filled()))
    }))?;
    let lost_y = y.1 / 1.5;
    chart.draw_series(
        data.pings
            .iter()
            .filter(|p| p.rtt_ms.is_none())
            .map(|p| Cross::new(at(p.t_ms, lost_y), 4, RED.stroke_width(2))),
    )?;
    draw_marks(&mut chart, data, x_max, y, true)
}

fn draw_gaps<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    data: &ProbeData,
    x_max: f64,
) -> DrawResult<(), DB> {
    let reported = data.guest_max_gap_ms_by_report.iter().map(|r| r.1);
    let gap_max = data
        .gaps
        .iter()
        .map(|g| g.gap_ms)
        .chain(reported)
        .fold(0.0, f64::max);
    let y = (GAP_FLOOR_MS, top_ms(gap_max));
    let caption = "guest gaps (red: each gap, at its end; grey: largest per report)";
    let mut chart = panel(area, caption, "gap (ms)", x_max, y)?;
    let at = |t_ms: f64, v: f64| ((t_ms / 1000.0).clamp(0.0, x_max), v.clamp(y.0, y.1));
    chart.draw_series(LineSeries::new(
        data.guest_max_gap_ms_by_report
            .iter()
            .map(|&(t, g)| at(t, g)),
        REPORT_GREY.stroke_width(1),
    ))?;
    // A gap is a stem from the floor.
    for g in &data.gaps {
        let (x, top) = at(g.t_ms, g.gap_ms);
        let stem = [(x, y.0), (x, top)];
        chart.draw_series(LineSeries::new(stem, GAP_RED.stroke_width(2)))?;
    }
    chart.draw_series(
        data.gaps
            .iter()
            .map(|g| Circle::new(at(g.t_ms, g.gap_ms), 3, GAP_RED.filled())),
    )?;
    draw_marks(&mut chart, data, x_max, y, false)
}

/// The marks as vertical lines, labelled (if `labels`) near the top, a
/// label at one of three heights so that close marks stay readable.
fn draw_marks<DB: DrawingBackend>(
    chart: &mut Chart<'_, DB>,
    data: &ProbeData,
    x_max: f64,
    (floor, top): (f64, f64),
    labels: bool,
) -> DrawResult<(), DB> {
    for (i, m) in data.marks.iter().enumerate() {
        let x = (m.t_ms / 1000.0).clamp(0.0, x_max);
        let line = [(x, floor), (x, top)];
        chart.draw_series(LineSeries::new(line, MARK_GREEN.stroke_width(1)))?;
        if labels {
            let style = ("sans-serif", 13).into_font().color(&MARK_GREEN);
            let y = top / 1.15 / 2.2f64.powi((i % 3) as i32);
            let label = Text::new(format!(" {}", m.label), (x, y), style);
            chart.draw_series(std::iter::once(label))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::probe::{Gap, Mark, Ping};

    #[test]
    fn writes_a_png() {
        // 10 s: a migration from 3 s, stop-and-copy at 7.5 s (300 ms
        // paused), done at 7.8 s.
        let mut data = ProbeData::default();
        for i in 0..1000u32 {
            let t_ms = f64::from(i) * 10.0;
            let paused = (7500.0..7800.0).contains(&t_ms);
            let rtt_ms = if paused {
                (t_ms > 7700.0).then_some(7800.0 - t_ms)
            } else {
                Some(0.15 + f64::from(i % 7) / 20.0 + if t_ms > 3000.0 { 0.3 } else { 0.0 })
            };
            data.pings.push(Ping {
                t_ms,
                seq: u64::from(i),
                rtt_ms,
            });
        }
        for i in 0..100u32 {
            let t = f64::from(i) * 100.0;
            let max = if (7800.0..7900.0).contains(&t) {
                300.0
            } else {
                1.1
            };
            data.guest_max_gap_ms_by_report.push((t, max));
        }
        data.gaps = vec![
            Gap {
                t_ms: 3500.0,
                gap_ms: 12.0,
                id: 1,
            },
            Gap {
                t_ms: 5000.0,
                gap_ms: 25.0,
                id: 2,
            },
            Gap {
                t_ms: 7800.0,
                gap_ms: 300.0,
                id: 3,
            },
            Gap {
                t_ms: 9000.0,
                gap_ms: 0.001,
                id: 4,
            }, // below the axis: drawn at its floor
        ];
        for (t_ms, label) in [
            (3000.0, "migrate"),
            (7500.0, "stop-and-copy"),
            (7800.0, "done"),
        ] {
            data.marks.push(Mark {
                t_ms,
                label: label.into(),
            });
        }
        let dir = std::env::temp_dir().join(format!("tandem-probe-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("probe.png");
        plot(&data, &path).unwrap();
        let png = std::fs::read(&path).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        assert!(png.len() > 10_000, "{} bytes", png.len());
        // Empty records draw too.
        plot(&ProbeData::default(), &path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn unwritable_path_is_an_error() {
        let e = plot(&ProbeData::default(), Path::new("/nonexistent-dir/p.png")).unwrap_err();
        assert!(matches!(e, ProbeError::Plot(..)), "{e}");
    }
}
