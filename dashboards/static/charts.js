/* tokentrace charts: line and stacked-bar charts on <canvas>, no dependencies.
 *
 * A chart is <canvas class="chart" data-chart="ID"> next to <script type="application/json" id="ID">
 * holding {kind: "line"|"bars", x: [...], x_type: "time"|"index", unit: "ms"|"pct"|"bytes"|"count",
 * x_min, x_max (optional x range), series: [{name, y: [...], x: [...] (optional, line charts: its own x)}], hline: {name, value} (optional
 * dashed horizontal line, e.g. a limit)}. Time x values are epoch ms.
 * Data comes from the page's view function; this file only draws. */
(function () {
  "use strict";
  const PALETTE = ["#2f6fdb", "#3fa86a", "#e6a23c", "#9b6fd1", "#d64545", "#1ea5b8", "#8893a6", "#c0568f"];
  const NAMED = {max_entries: "#e6a23c", max_bytes: "#d64545", memory_pressure: "#9b6fd1", trim: "#8893a6",
                 superseded: "#1ea5b8",
                 // a node's time (the instances page): idle recedes, waiting stands out
                 compute: "#2f6fdb", "waiting on the ring": "#e6a23c", "rest of step": "#8893a6", idle: "#e3e7ee"};
  const PAD = {left: 56, right: 12, top: 22, bottom: 24};

  function fmt(unit, v) {
    if (v === null || v === undefined) return "n/a";
    if (unit === "pct") return (v * 100).toFixed(0) + " %";
    // The same rule as the server's fmt_ms, so a tooltip and a table never disagree.
    if (unit === "ms") return Math.abs(v) >= 1000 ? (v / 1000).toFixed(2) + " s" : v.toFixed(1) + " ms";
    if (unit === "bytes") {
      const units = ["B", "KiB", "MiB", "GiB"];
      let i = 0;
      while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
      return (i ? v.toFixed(1) : v.toFixed(0)) + " " + units[i];
    }
    return Math.abs(v) >= 100 ? v.toFixed(0) : String(Math.round(v * 100) / 100);
  }

  function clock(ms, span) {
    const d = new Date(ms);
    const p = (n, w) => String(n).padStart(w || 2, "0");
    const hms = p(d.getHours()) + ":" + p(d.getMinutes()) + ":" + p(d.getSeconds());
    return span < 5000 ? hms + "." + p(d.getMilliseconds(), 3) : hms;
  }

  function niceStep(span, target) {
    const raw = span / Math.max(1, target);
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    for (const m of [1, 2, 5, 10]) if (m * mag >= raw) return m * mag;
    return 10 * mag;
  }

  // Time-axis steps in ms: round clock units, so ticks fall on :00, :15, :30 ...
  const TIME_STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 15e3, 3e4, 6e4, 12e4, 3e5, 6e5, 9e5,
                      18e5, 36e5, 72e5, 108e5, 216e5, 432e5, 864e5];

  function timeStep(span, target) {
    const raw = span / Math.max(1, target);
    return TIME_STEPS.find((s) => s >= raw) || TIME_STEPS[TIME_STEPS.length - 1];
  }

  function setup(canvas) {
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth, h = canvas.clientHeight;
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    ctx.font = "11px system-ui, sans-serif";
    return {ctx, w, h};
  }

  function colorOf(series, i) { return series.color || NAMED[series.name] || PALETTE[i % PALETTE.length]; }

  function draw(canvas, spec) {
    const {ctx, w, h} = setup(canvas);
    const xs = spec.x || [];
    const series = spec.series || [];
    const stacked = spec.kind === "bars";
    const xOf = (s) => s.x || xs;
    const all = stacked ? xs : [].concat(...series.map(xOf));
    if (!all.length || !series.length) {
      ctx.fillStyle = "#667085";
      ctx.textAlign = "center";
      ctx.fillText(spec.empty || "no data in this window", w / 2, h / 2);
      return;
    }
    // A time chart spans its whole window (x_min..x_max) so that one sample is not stretched wide.
    let x0 = spec.x_min !== undefined && spec.x_min !== null ? spec.x_min : Math.min(...all);
    let x1 = spec.x_max !== undefined && spec.x_max !== null ? spec.x_max : Math.max(...all);
    if (stacked) x1 += (xs.length > 1 ? xs[1] - xs[0] : 1);
    if (x1 === x0) { x0 -= 1; x1 += 1; }
    let y1 = 0;
    if (stacked) {
      for (let i = 0; i < xs.length; i++) {
        let sum = 0;
        for (const s of series) sum += s.y[i] || 0;
        y1 = Math.max(y1, sum);
      }
    } else {
      for (const s of series) for (const v of s.y) if (v !== null && v > y1) y1 = v;
    }
    if (spec.hline) y1 = Math.max(y1, spec.hline.value);
    if (spec.unit === "pct") y1 = Math.max(y1, 1);
    if (y1 <= 0) y1 = 1;
    y1 *= 1.08;
    const pw = w - PAD.left - PAD.right, ph = h - PAD.top - PAD.bottom;
    const X = (v) => PAD.left + (v - x0) / (x1 - x0) * pw;
    const Y = (v) => PAD.top + ph - v / y1 * ph;
    // grid and y labels
    ctx.strokeStyle = "#e3e6eb";
    ctx.fillStyle = "#667085";
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    const ystep = spec.unit === "count" ? Math.max(1, niceStep(y1, 4)) : niceStep(y1, 4);
    for (let v = 0; v <= y1; v += ystep) {
      ctx.beginPath(); ctx.moveTo(PAD.left, Y(v)); ctx.lineTo(w - PAD.right, Y(v)); ctx.stroke();
      ctx.fillText(fmt(spec.unit, v), PAD.left - 6, Y(v));
    }
    // x labels
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    const xticks = Math.max(2, Math.floor(pw / 110));
    const xstep = spec.x_type === "time" ? timeStep(x1 - x0, xticks) : Math.max(1, niceStep(x1 - x0, xticks));
    for (let v = Math.ceil(x0 / xstep) * xstep; v <= x1; v += xstep) {
      ctx.fillText(spec.x_type === "time" ? clock(v, x1 - x0) : String(Math.round(v)), X(v), h - PAD.bottom + 6);
    }
    if (stacked) {
      const bw = Math.max(1, (xs.length > 1 ? X(xs[1]) - X(xs[0]) : pw) - 2);
      const base = new Array(xs.length).fill(0);
      series.forEach((s, k) => {
        ctx.fillStyle = colorOf(s, k);
        for (let i = 0; i < xs.length; i++) {
          const v = s.y[i] || 0;
          if (!v) continue;
          ctx.fillRect(X(xs[i]) + 1, Y(base[i] + v), bw, Y(base[i]) - Y(base[i] + v));
          base[i] += v;
        }
      });
    } else {
      series.forEach((s, k) => {
        ctx.strokeStyle = colorOf(s, k);
        ctx.lineWidth = 1.6;
        const sx = xOf(s);
        ctx.beginPath();
        let pen = false;
        for (let i = 0; i < sx.length; i++) {
          const v = s.y[i];
          if (v === null || v === undefined) { pen = false; continue; }
          if (pen) ctx.lineTo(X(sx[i]), Y(v)); else ctx.moveTo(X(sx[i]), Y(v));
          pen = true;
        }
        ctx.stroke();
        // Mark the points when there are few, and always a point no line reaches (gaps on both sides).
        ctx.fillStyle = colorOf(s, k);
        const gap = (i) => i < 0 || i >= sx.length || s.y[i] === null || s.y[i] === undefined;
        for (let i = 0; i < sx.length; i++) {
          if (!gap(i) && (sx.length < 40 || (gap(i - 1) && gap(i + 1)))) ctx.fillRect(X(sx[i]) - 2, Y(s.y[i]) - 2, 4, 4);
        }
      });
    }
    if (spec.hline) {
      ctx.setLineDash([5, 4]);
      ctx.strokeStyle = "#d64545";
      ctx.beginPath();
      ctx.moveTo(PAD.left, Y(spec.hline.value));
      ctx.lineTo(w - PAD.right, Y(spec.hline.value));
      ctx.stroke();
      ctx.setLineDash([]);
    }
    // legend
    ctx.textAlign = "left";
    ctx.textBaseline = "middle";
    let lx = PAD.left;
    const items = series.map((s, k) => [s.name, colorOf(s, k)]);
    if (spec.hline) items.push([spec.hline.name, "#d64545"]);
    for (const [name, color] of items) {
      ctx.fillStyle = color;
      ctx.fillRect(lx, 6, 10, 10);
      ctx.fillStyle = "#1d2330";
      ctx.fillText(name, lx + 14, 11);
      lx += 24 + ctx.measureText(name).width;
    }
  }

  function renderAll() {
    for (const canvas of document.querySelectorAll("canvas.chart[data-chart]")) {
      const source = document.getElementById(canvas.dataset.chart);
      if (source) draw(canvas, JSON.parse(source.textContent));
    }
  }

  window.tokentraceCharts = {draw, renderAll, fmt, timeStep};
  document.addEventListener("DOMContentLoaded", renderAll);
  document.addEventListener("tokentrace:refreshed", renderAll);
  let resizeTimer = null;
  window.addEventListener("resize", () => { clearTimeout(resizeTimer); resizeTimer = setTimeout(renderAll, 100); });
})();
