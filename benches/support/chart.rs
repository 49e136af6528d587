//! SVG charts the benches draw of their own figures (plotters, SVG backend only): lines of a
//! figure against a count, and groups of bars. Written only where asked (`BENCH_CHARTS=dir`, an absolute path or one relative to `benches/`,
//! where Cargo runs a bench), so
//! that a run leaves the committed charts alone unless it is meant to redraw them.

use std::path::PathBuf;

use plotters::prelude::*;

/// Where to write the charts, from `BENCH_CHARTS`; `None` draws nothing.
pub fn dir() -> Option<PathBuf> {
    let dir = PathBuf::from(std::env::var_os("BENCH_CHARTS")?);
    std::fs::create_dir_all(&dir)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
    Some(dir)
}

const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// One line of a chart: its name and its points.
#[derive(Debug)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// A line chart of `series` (x on a log scale when `log_x`), y from zero, written to `file`.
pub fn lines(
    file: &str,
    title: &str,
    x_label: &str,
    y_label: &str,
    log_x: bool,
    series: &[Series],
) {
    let Some(dir) = dir() else { return };
    let path = dir.join(file);
    let all = || series.iter().flat_map(|s| s.points.iter().copied());
    let (x_min, x_max) = all().fold((f64::MAX, f64::MIN), |(lo, hi), (x, _)| {
        (lo.min(x), hi.max(x))
    });
    let y_max = all().fold(0.0f64, |hi, (_, y)| hi.max(y)) * 1.15;
    let y_max = if y_max > 0.0 { y_max } else { 1.0 };
    let root = SVGBackend::new(&path, (720, 420)).into_drawing_area();
    root.fill(&WHITE).expect("a chart");
    let mut builder = ChartBuilder::on(&root);
    builder
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70);
    if log_x {
        let mut chart = builder
            .build_cartesian_2d((x_min * 0.8..x_max * 1.25).log_scale(), 0.0..y_max)
            .expect("a chart");
        chart
            .configure_mesh()
            .x_labels(6)
            .x_desc(x_label)
            .y_desc(y_label)
            .x_label_formatter(&|x| count(*x))
            .y_label_formatter(&|y| count(*y))
            .draw()
            .expect("a chart");
        for (i, s) in series.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            chart
                .draw_series(LineSeries::new(s.points.clone(), color.stroke_width(2)))
                .expect("a chart")
                .label(&s.name)
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 16, y)], color.stroke_width(2))
                });
            chart
                .draw_series(s.points.iter().map(|&p| Circle::new(p, 3, color.filled())))
                .expect("a chart");
        }
        legend(&mut chart, SeriesLabelPosition::LowerRight);
    } else {
        let mut chart = builder
            .build_cartesian_2d(x_min..x_max, 0.0..y_max)
            .expect("a chart");
        chart
            .configure_mesh()
            .x_desc(x_label)
            .y_desc(y_label)
            .y_label_formatter(&|y| count(*y))
            .draw()
            .expect("a chart");
        for (i, s) in series.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            chart
                .draw_series(LineSeries::new(s.points.clone(), color.stroke_width(2)))
                .expect("a chart")
                .label(&s.name)
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 16, y)], color.stroke_width(2))
                });
        }
        legend(&mut chart, SeriesLabelPosition::UpperLeft);
    }
    root.present().expect("the chart is written");
    println!("chart: {}", path.display());
}

fn legend<'a, DB: DrawingBackend + 'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
    position: SeriesLabelPosition,
) {
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(position)
        .draw()
        .expect("a chart");
}

/// Groups of bars: for each group (a workload), one bar per name, written to `file`.
pub fn bars(file: &str, title: &str, y_label: &str, names: &[&str], groups: &[(&str, Vec<f64>)]) {
    let Some(dir) = dir() else { return };
    let path = dir.join(file);
    let y_max = groups
        .iter()
        .flat_map(|(_, values)| values.iter().copied())
        .fold(0.0f64, f64::max)
        * 1.15;
    let width = names.len() + 1;
    let slots = groups.len() * width;
    let root = SVGBackend::new(&path, (820, 440)).into_drawing_area();
    root.fill(&WHITE).expect("a chart");
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..slots as f64, 0.0..y_max.max(1.0))
        .expect("a chart");
    let group_names: Vec<&str> = groups.iter().map(|(name, _)| *name).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(slots * 2)
        .x_label_formatter(&|x| {
            let slot = *x - (names.len() as f64) / 2.0;
            let group = (slot / width as f64).round();
            let centre = group * width as f64 + (names.len() as f64) / 2.0;
            if ((*x) - centre).abs() < 0.01 && group >= 0.0 {
                group_names
                    .get(group as usize)
                    .map_or(String::new(), |n| (*n).to_owned())
            } else {
                String::new()
            }
        })
        .y_desc(y_label)
        .y_label_formatter(&|y| count(*y))
        .draw()
        .expect("a chart");
    for (i, name) in names.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let bars = groups
            .iter()
            .enumerate()
            .filter_map(move |(g, (_, values))| {
                let value = *values.get(i)?;
                let x = (g * width + i) as f64;
                (value > 0.0)
                    .then(|| Rectangle::new([(x + 0.05, 0.0), (x + 0.95, value)], color.filled()))
            });
        chart
            .draw_series(bars)
            .expect("a chart")
            .label(*name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .expect("a chart");
    root.present().expect("the chart is written");
    println!("chart: {}", path.display());
}

/// 1200 as "1.2k", 5000000 as "5M".
pub fn count(value: f64) -> String {
    let abs = value.abs();
    if abs >= 1e6 {
        format!("{}M", trim(value / 1e6))
    } else if abs >= 1e3 {
        format!("{}k", trim(value / 1e3))
    } else {
        trim(value)
    }
}

fn trim(value: f64) -> String {
    let text = format!("{value:.1}");
    text.strip_suffix(".0").map(str::to_owned).unwrap_or(text)
}
