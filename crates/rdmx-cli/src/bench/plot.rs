//! `--plot FILE.svg`: a sweep's bandwidth (or latency) against message size, log-log,
//! one line per provider.

use std::path::Path;

use plotters::prelude::*;

use super::args::Test;
use super::report::Row;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Draws `series` (provider name, rows) into an SVG file at `path`.
pub(crate) fn draw(
    path: &Path,
    test: Test,
    gbits: bool,
    series: &[(String, Vec<Row>)],
) -> Result<(), BoxError> {
    let points: Vec<(&str, Vec<(f64, f64)>)> = series
        .iter()
        .map(|(name, rows)| {
            let pts = rows
                .iter()
                .map(|r| (r.bytes() as f64, r.headline(gbits)))
                .filter(|&(_, y)| y > 0.0 && y.is_finite())
                .collect();
            (name.as_str(), pts)
        })
        .collect();
    let all = || points.iter().flat_map(|(_, p)| p.iter().copied());
    if all().next().is_none() {
        return Err("--plot: nothing to draw".into());
    }
    let (x0, x1) = all().fold((f64::MAX, 0f64), |(a, b), (x, _)| (a.min(x), b.max(x)));
    let (y0, y1) = all().fold((f64::MAX, 0f64), |(a, b), (_, y)| (a.min(y), b.max(y)));
    let y_desc = if test.is_bw() {
        format!(
            "Bandwidth, average [{}]",
            if gbits { "Gb/s" } else { "MiB/s" }
        )
    } else if test.halves_round_trip() {
        "Latency, typical (median), half round trip [usec]".to_string()
    } else {
        "Latency, typical (median), round trip [usec]".to_string()
    };
    let err = |e: DrawingAreaErrorKind<_>| format!("--plot {}: {e}", path.display());

    let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("rdmx bench {} ({})", test.name(), test.title()),
            ("sans-serif", 22),
        )
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(80)
        .build_cartesian_2d(
            (x0 / 1.5..x1 * 1.5)
                .log_scale()
                .with_key_points(size_ticks(x0, x1)),
            (y0 / 1.5..y1 * 1.5).log_scale(),
        )
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("Message size [bytes]")
        .y_desc(y_desc)
        .x_label_formatter(&|x| size_label(*x))
        .y_label_formatter(&|y| figure_label(*y))
        .draw()
        .map_err(err)?;
    for (k, (name, pts)) in points.iter().enumerate() {
        let color = Palette99::pick(k).to_rgba();
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
            .map_err(err)?
            .label(*name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// Powers of two from `x0` to `x1`, every other one when there are many: message sizes
/// read better in K and M than in decades.
fn size_ticks(x0: f64, x1: f64) -> Vec<f64> {
    let all: Vec<f64> = (0..=40)
        .map(|k| (1u64 << k) as f64)
        .filter(|&x| x >= x0 && x <= x1)
        .collect();
    let step = if all.len() > 12 { 2 } else { 1 };
    all.into_iter().step_by(step).collect()
}

/// A bandwidth or latency figure with as many decimals as its size needs.
fn figure_label(y: f64) -> String {
    match y {
        _ if y >= 100.0 => format!("{y:.0}"),
        _ if y >= 1.0 => format!("{y:.1}"),
        _ => format!("{y:.3}"),
    }
}

/// 2, 1K, 64K, 8M ...
fn size_label(x: f64) -> String {
    let x = x.round() as u64;
    match x {
        _ if x >= 1 << 20 && x % (1 << 20) == 0 => format!("{}M", x >> 20),
        _ if x >= 1 << 10 && x % (1 << 10) == 0 => format!("{}K", x >> 10),
        _ => x.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_labels() {
        assert_eq!(size_label(2.0), "2");
        assert_eq!(size_label(65536.0), "64K");
        assert_eq!(size_label(8388608.0), "8M");
        let t = size_ticks(2.0, 8388608.0);
        assert_eq!((t[0], t[t.len() - 1], t.len()), (2.0, 8388608.0, 12));
        assert_eq!(size_ticks(64.0, 256.0), [64.0, 128.0, 256.0]);
        assert_eq!(figure_label(8088.82), "8089");
        assert_eq!(figure_label(5.26), "5.3");
    }
}
