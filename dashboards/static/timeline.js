/* tokentrace timeline: one lane per instance, one bar per request, on a single <canvas>.
 *
 * Input is the columnar /timeline.json twin (times in ms from t0_ns). Requests are packed into rows
 * inside their lane (first row free at their start), drawn phase by phase (one path per colour, so
 * 10,000 requests are a few dozen thousand rects and a handful of fills), and found again under the
 * mouse by a binary search in their row. Wheel zooms around the cursor, drag pans, double-click
 * resets; hover shows a request's numbers, click opens /requests/{id}. A distributed instance's lane
 * opens into its nodes (a click on its name: the twin is fetched again with open=<instance>): one
 * row per rank under its requests, each engine step of that rank a block, a timed step split into
 * its compute, its wait on the ring and the rest, in proportion (not in order). */
(function () {
  "use strict";
  const css = getComputedStyle(document.documentElement);
  const color = (name) => css.getPropertyValue("--" + name).trim();
  const PHASE_COLORS = {load_wait: color("load_wait"), queue: color("queue"), prefill: color("prefill"),
                        decode: color("decode")};
  const CHUNK_ALT = "#78a6ec";
  const OTHER = color("other");
  const PANEL = color("panel") || "#fff", BAD = color("bad") || "#d64545";
  const ABNORMAL = color("abnormal") || "#1d2330";
  // A bar's category stripe: the colour of the phase it is named after (undecomposed: grey; a
  // request that did not complete: red).
  const CATEGORY_COLORS = {cold_start: color("load_wait"), queueing: color("queue"), prefill: color("prefill"),
                           decode: color("decode"), undecomposed: color("other")};
  const GUTTER = 148, AXIS = 24, MARK = 12, GAP = 6, RIGHT = 12, LANE_MIN = 42, NODE_H = 16;
  // A node's step (the instances page's colours): compute, waiting on the ring, the rest; untimed: grey.
  const STEP_COLORS = {compute: "#2f6fdb", ring: "#e6a23c", rest: "#8893a6", untimed: "#b8c0cc"};
  const fmt = (v) => window.tokentraceCharts.fmt("ms", v);

  // The compared metric of each component (the slowness verdict's baseline), for the words below.
  const METRICS = {cold_start: ["load wait", ""], queueing: ["queue", ""], prefill: ["prefill", "/uncached token"],
                   decode: ["TPOT", ""]};
  /* The abnormal test of request i in words: "abnormal: queue 412 ms vs 1.2 ms baseline", "normal",
   * "no baseline (2 comparable requests)" or "not judged" (a category that names no component). */
  const abnormalText = (d, i) => {
    const r = d.requests, judged = r.abnormal[i];
    if (r.samples[i] === null) return "not judged";
    if (judged === null) return `no baseline (${r.samples[i]} comparable request${r.samples[i] === 1 ? "" : "s"})`;
    if (!judged) return "normal";
    const [name, per] = METRICS[d.categories[r.category[i]]];
    return `abnormal: ${name} ${fmt(r.observed[i])}${per} vs ${fmt(r.baseline[i])}${per} baseline`;
  };

  class Timeline {
    constructor(canvas, tooltip, summary) {
      this.canvas = canvas;
      this.tooltip = tooltip;
      this.summary = summary;
      this.data = null;
      this.view = null;        // [v0, v1] in ms from origin
      this.origin = null;      // t0_ns of the first load; later loads are shifted onto it
      this.hover = -1;
      this.pending = false;
      this.firstDrawMs = null;
      this.bind();
    }

    /* ---- data ---------------------------------------------------------------------------- */
    load(data) {
      const r = data.requests;
      if (this.origin === null) this.origin = data.t0_ns;
      const shift = (data.t0_ns - this.origin) / 1e6;
      const rebase = (arr) => Float64Array.from(arr, (v) => v + shift);
      const followNow = this.view && this.data && this.view[1] >= this.data.now - 1;
      const oldNow = this.data ? this.data.now : 0;
      this.data = data;
      this.n = r.id.length;
      this.start = rebase(r.start);
      this.end = rebase(r.end);
      data.now += shift;
      this.chunkStart = rebase(data.chunks.start);
      this.chunkEnd = rebase(data.chunks.end);
      this.evT = rebase(data.evictions.t);
      this.loadStart = rebase(data.loads.start);
      this.loadEnd = rebase(data.loads.end);
      this.stepStart = rebase(data.steps.start);
      this.stepEnd = rebase(data.steps.end);
      this.layout();
      if (!this.view) this.reset();
      else if (followNow) { const d = data.now - oldNow; this.view = [this.view[0] + d, this.view[1] + d]; }
      this.summary.textContent = this.n.toLocaleString() + (this.n === 1 ? " request" : " requests") + " on " +
        data.lanes.length + " instance" +
        (data.lanes.length === 1 ? "" : "s") + (data.truncated ? " (newest " + this.n + " shown)" : "") +
        (data.open.length ? " · " + data.open.join(", ") + " opened into its nodes (" +
          data.steps.node.length.toLocaleString() + " steps" + (data.steps_truncated ? ", the newest" : "") + ")"
          : data.nodes.lane.length ? " · click a cluster's name to open it into its nodes" : "");
      this.canvas.dataset.open = data.open.join(",");
      const legend = document.getElementById("tl-node-legend");
      if (legend) legend.style.visibility = data.open.length ? "visible" : "hidden";  // its room kept: no jump
      this.draw();
    }

    layout() {
      const r = this.data.requests, lanes = this.data.lanes.length;
      const rowEnds = Array.from({length: lanes}, () => []);
      this.rows = Array.from({length: lanes}, () => []);   // rows[lane][row] = request indexes by start
      this.row = new Int32Array(this.n);
      const order = Array.from({length: this.n}, (_, i) => i).sort((a, b) => this.start[a] - this.start[b]);
      for (const i of order) {
        const lane = r.lane[i], ends = rowEnds[lane];
        let k = 0;
        while (k < ends.length && ends[k] > this.start[i]) k++;
        if (k === ends.length) { ends.push(0); this.rows[lane].push([]); }
        ends[k] = this.end[i];
        this.row[i] = k;
        this.rows[lane][k].push(i);
      }
      // Node rows per lane (ring order), which lanes are open, and each node's steps (sorted by start).
      const nodes = this.data.nodes;
      this.laneNodes = Array.from({length: lanes}, () => []);
      nodes.lane.forEach((lane, k) => this.laneNodes[lane].push(k));
      this.opened = new Set(this.data.open.map((name) => this.data.lanes.indexOf(name)));
      this.stepFrom = new Int32Array(nodes.lane.length).fill(0);
      this.stepTo = new Int32Array(nodes.lane.length).fill(0);
      const sn = this.data.steps.node;
      for (let k = 0; k < sn.length; k++) {
        if (k === 0 || sn[k] !== sn[k - 1]) this.stepFrom[sn[k]] = k;
        this.stepTo[sn[k]] = k + 1;
      }
      this.chunkOrdinal = new Int32Array(this.chunkStart.length);
      const seen = new Map();
      for (let c = 0; c < this.chunkStart.length; c++) {
        const q = this.data.chunks.request[c];
        const k = seen.get(q) || 0;
        this.chunkOrdinal[c] = k;
        seen.set(q, k + 1);
      }
      this.resize();
    }

    resize() {
      const lanes = this.data ? this.data.lanes.length : 0;
      const counts = this.rows ? this.rows.map((rows) => Math.max(1, rows.length)) : [];
      const total = counts.reduce((a, b) => a + b, 0) || 1;
      const room = Math.max(260, window.innerHeight - this.canvas.getBoundingClientRect().top - 24);
      this.rowH = Math.max(3, Math.min(16, Math.floor((room - AXIS - lanes * (MARK + GAP)) / total)));
      this.laneTop = [];
      this.nodeTop = new Float64Array(this.data ? this.data.nodes.lane.length : 0);
      let y = AXIS;
      // At least LANE_MIN tall: the instance name and row count are drawn in the gutter. An opened
      // lane's node rows go under its requests, NODE_H each.
      counts.forEach((c, lane) => {
        this.laneTop.push(y);
        let h = MARK + c * this.rowH;
        if (this.opened && this.opened.has(lane)) {
          h = Math.max(h + 4, MARK + 26);  // below the lane's name and counts in the gutter
          for (const k of this.laneNodes[lane]) { this.nodeTop[k] = y + h; h += NODE_H; }
        }
        y += Math.max(LANE_MIN, h) + GAP;
      });
      this.height = Math.max(y, 120);
      const dpr = window.devicePixelRatio || 1;
      this.width = this.canvas.clientWidth;
      this.canvas.style.height = this.height + "px";
      this.canvas.width = Math.round(this.width * dpr);
      this.canvas.height = Math.round(this.height * dpr);
      this.ctx = this.canvas.getContext("2d");
      this.ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    }

    reset() {
      let lo = Infinity, hi = -Infinity;
      for (let i = 0; i < this.n; i++) { lo = Math.min(lo, this.start[i]); hi = Math.max(hi, this.end[i]); }
      for (let i = 0; i < this.loadStart.length; i++) { lo = Math.min(lo, this.loadStart[i]); hi = Math.max(hi, this.loadEnd[i]); }
      for (const t of this.evT) { lo = Math.min(lo, t); hi = Math.max(hi, t); }
      if (!isFinite(lo)) { lo = 0; hi = Math.max(1, this.data.now); }
      // A busy cluster's view runs to now and follows it live; traffic that stopped long ago (more
      // than its own length before now) is shown on its own rather than squeezed against empty time.
      if (this.data.window.since_ns !== null && this.data.now - hi <= hi - lo) hi = Math.max(hi, this.data.now);
      const pad = Math.max(1, (hi - lo) * 0.02);
      this.view = [lo - pad, hi + pad];
    }

    /* ---- geometry ------------------------------------------------------------------------ */
    x(t) { return GUTTER + (t - this.view[0]) / (this.view[1] - this.view[0]) * (this.width - GUTTER - RIGHT); }
    t(x) { return this.view[0] + (x - GUTTER) / (this.width - GUTTER - RIGHT) * (this.view[1] - this.view[0]); }
    y(i) { return this.laneTop[this.data.requests.lane[i]] + MARK + this.row[i] * this.rowH; }

    /* Phase boundaries of request i: [start, +load_wait, +queue, +prefill, +decode], capped at its end. */
    bounds(i) {
      const r = this.data.requests;
      const b = [this.start[i]];
      // An unknown phase (null) draws no bar: its time stays grey with what no phase covers.
      for (const p of ["load_wait", "queue", "prefill", "decode"]) b.push(Math.min(this.end[i], b[b.length - 1] + (r[p][i] ?? 0)));
      return b;
    }

    /* ---- drawing ------------------------------------------------------------------------- */
    draw() {
      if (this.pending) return;
      this.pending = true;
      requestAnimationFrame(() => { this.pending = false; this.paint(); });
    }

    paint() {
      const ctx = this.ctx, d = this.data, r = d.requests, h = Math.max(1, this.rowH - 1);
      const [v0, v1] = this.view;
      ctx.clearRect(0, 0, this.width, this.height);
      this.paintLanes(ctx);
      const ticks = this.ticks();
      ctx.strokeStyle = "#e3e6eb";  // grid under the bars, labels over them (paintAxis)
      ctx.lineWidth = 1;
      ctx.beginPath();
      for (const t of ticks.at) { const x = this.x(t); ctx.moveTo(x, AXIS - 4); ctx.lineTo(x, this.height); }
      ctx.stroke();
      const visible = [];
      for (let i = 0; i < this.n; i++) if (this.end[i] >= v0 && this.start[i] <= v1) visible.push(i);
      // Bars stay right of the gutter (the instance names), however far the view is zoomed.
      ctx.save();
      ctx.beginPath();
      ctx.rect(GUTTER, 0, this.width - GUTTER, this.height);
      ctx.clip();
      // Whole request first (what no phase covers shows as "other"), at least 1 px wide so none vanishes.
      ctx.fillStyle = OTHER;
      ctx.beginPath();
      for (const i of visible) {
        const x0 = this.x(this.start[i]);
        ctx.rect(x0, this.y(i), Math.max(1, this.x(this.end[i]) - x0), h);
      }
      ctx.fill();
      const bounds = visible.map((i) => this.bounds(i));
      d.phases.forEach((phase, p) => {
        ctx.fillStyle = PHASE_COLORS[phase];
        ctx.beginPath();
        visible.forEach((i, k) => {
          const b = bounds[k];
          if (b[p + 1] <= b[p]) return;
          const x0 = this.x(b[p]);
          ctx.rect(x0, this.y(i), Math.max(0.5, this.x(b[p + 1]) - x0), h);
        });
        ctx.fill();
      });
      // Every second prefill chunk in a lighter blue: the chunk boundaries show inside the prefill.
      ctx.fillStyle = CHUNK_ALT;
      ctx.beginPath();
      for (let c = 0; c < this.chunkStart.length; c++) {
        if (this.chunkOrdinal[c] % 2 === 0 || this.chunkEnd[c] < v0 || this.chunkStart[c] > v1) continue;
        const i = d.chunks.request[c], x0 = this.x(this.chunkStart[c]);
        ctx.rect(x0, this.y(i), Math.max(0.5, this.x(this.chunkEnd[c]) - x0), h);
      }
      ctx.fill();
      this.paintMarks(ctx, visible, h);
      this.paintNodes(ctx);
      if (this.hover >= 0) {
        const i = this.hover, x0 = this.x(this.start[i]);
        ctx.strokeStyle = "#1d2330";
        ctx.lineWidth = 1.5;
        ctx.strokeRect(x0 - 1, this.y(i) - 1, Math.max(1, this.x(this.end[i]) - x0) + 2, h + 2);
      }
      this.paintMarkers(ctx);
      ctx.restore();
      this.paintAxis(ctx, ticks);
      if (!d.lanes.length) {
        ctx.fillStyle = "#667085";
        ctx.font = "13px system-ui, sans-serif";
        ctx.textAlign = "center";
        ctx.fillText("No requests in this window yet: point an engine at this collector or widen the window.",
                     this.width / 2, AXIS + 40);
      }
      this.canvas.dataset.drawn = String(visible.length);
      this.canvas.dataset.requests = String(this.n);
      if (this.firstDrawMs === null) {
        this.firstDrawMs = performance.now();
        window.tokentraceTimeline.firstDrawMs = this.firstDrawMs;
      }
    }

    paintLanes(ctx) {
      const d = this.data;
      ctx.font = "12px system-ui, sans-serif";
      ctx.textBaseline = "middle";
      d.lanes.forEach((name, lane) => {
        const top = this.laneTop[lane];
        const bottom = lane + 1 < d.lanes.length ? this.laneTop[lane + 1] - GAP : this.height - GAP;
        ctx.fillStyle = lane % 2 ? "#fafbfc" : "#f3f5f8";
        ctx.fillRect(0, top - GAP / 2, this.width, bottom - top + GAP);
        ctx.fillStyle = "#1d2330";
        ctx.textAlign = "left";
        const nodes = this.laneNodes[lane], open = this.opened.has(lane);
        let label = (nodes.length ? (open ? "▾ " : "▸ ") : "") + (name || "(no instance)");
        while (label.length > 3 && ctx.measureText(label).width > GUTTER - 16) label = label.slice(0, -2) + "…";
        ctx.fillText(label, 8, top + MARK + 6);
        const rows = this.rows[lane].length;
        ctx.fillStyle = "#667085";
        ctx.font = "11px system-ui, sans-serif";
        ctx.fillText(rows + " row" + (rows === 1 ? "" : "s") + (nodes.length ? " · " + nodes.length + " nodes" : ""),
                     8, top + MARK + 20);
        if (open) {
          ctx.font = "10px system-ui, sans-serif";
          for (const k of nodes) {
            let text = "rank " + d.nodes.rank[k] + (d.nodes.placement[k] ? " · " + d.nodes.placement[k] : "");
            while (text.length > 3 && ctx.measureText(text).width > GUTTER - 20) text = text.slice(0, -2) + "…";
            ctx.fillText(text, 16, this.nodeTop[k] + NODE_H / 2);
          }
        }
        ctx.font = "12px system-ui, sans-serif";
      });
    }

    /* An opened lane's nodes: each step of each rank a block on its row; a timed step split into
     * compute, ring wait and the rest of the step, in proportion. */
    paintNodes(ctx) {
      const d = this.data, [v0, v1] = this.view, st = d.steps, h = NODE_H - 4;
      const paths = {compute: [], ring: [], rest: [], untimed: []};
      let drawn = 0;
      for (const lane of this.opened) {
        for (const k of this.laneNodes[lane]) {
          const y = this.nodeTop[k] + 2;
          ctx.fillStyle = "rgba(255,255,255,0.7)";
          ctx.fillRect(GUTTER, y - 1, this.width - GUTTER, h + 2);
          let lo = this.stepFrom[k], hi = this.stepTo[k];
          while (lo < hi) {  // first step that ends after v0 (steps of one rank do not overlap)
            const mid = (lo + hi) >> 1;
            if (this.stepEnd[mid] < v0) lo = mid + 1; else hi = mid;
          }
          for (let i = lo; i < this.stepTo[k] && this.stepStart[i] <= v1; i++) {
            const x0 = this.x(this.stepStart[i]), w = Math.max(0.5, this.x(this.stepEnd[i]) - x0);
            drawn++;
            if (st.compute[i] === null) { paths.untimed.push([x0, y, w]); continue; }
            const whole = this.stepEnd[i] - this.stepStart[i] || 1;
            const c = w * Math.min(1, st.compute[i] / whole), r = w * Math.min(1, (st.ring[i] || 0) / whole);
            paths.compute.push([x0, y, c]);
            paths.ring.push([x0 + c, y, Math.min(r, w - c)]);
            paths.rest.push([x0 + c + r, y, Math.max(0, w - c - r)]);
          }
        }
      }
      for (const [part, rects] of Object.entries(paths)) {
        ctx.fillStyle = STEP_COLORS[part];
        ctx.beginPath();
        for (const [x, y, w] of rects) if (w > 0) ctx.rect(x, y, w, h);
        ctx.fill();
      }
      this.canvas.dataset.nodeSteps = String(drawn);
    }

    paintMarkers(ctx) {
      const d = this.data, [v0, v1] = this.view;
      ctx.fillStyle = "#8893a6";
      for (let k = 0; k < this.loadStart.length; k++) {
        if (this.loadEnd[k] < v0 || this.loadStart[k] > v1) continue;
        const node = d.loads.node[k];
        // A rank's own load: on its node's row, when its lane is open.
        if (node !== null && !this.opened.has(d.loads.lane[k])) continue;
        const x0 = Math.max(GUTTER, this.x(this.loadStart[k])), x1 = this.x(this.loadEnd[k]);
        const top = node !== null ? this.nodeTop[node] + 2 : this.laneTop[d.loads.lane[k]] + 2;
        ctx.fillRect(x0, top, Math.max(2, x1 - x0), MARK - 4);
        if (x1 - x0 > 60) {
          ctx.fillStyle = "#fff";
          ctx.font = "10px system-ui, sans-serif";
          ctx.textAlign = "left";
          ctx.fillText("model load", x0 + 4, top + (MARK - 4) / 2);
          ctx.fillStyle = "#8893a6";
        }
      }
      ctx.fillStyle = color("bad");
      for (let k = 0; k < this.evT.length; k++) {
        const t = this.evT[k];
        if (t < v0 || t > v1) continue;
        const x = this.x(t), top = this.laneTop[d.evictions.lane[k]] + 1;
        ctx.beginPath();
        ctx.moveTo(x - 4, top); ctx.lineTo(x + 4, top); ctx.lineTo(x, top + MARK - 3);
        ctx.fill();
      }
    }

    /* Tick times (ms from the origin) on round clock times, and the step between them. */
    ticks() {
      const [v0, v1] = this.view, span = v1 - v0, at = [];
      const step = span < 1 ? Math.pow(10, Math.floor(Math.log10(span / 4)))
        : window.tokentraceCharts.timeStep(span, Math.max(2, (this.width - GUTTER) / 120));
      const origin = this.origin / 1e6;
      // Align in epoch ms, then back to ms from the origin.
      for (let t = Math.ceil((origin + v0) / step) * step - origin; t <= v1; t += step) {
        if (this.x(t) >= GUTTER) at.push(t);
      }
      return {at, step};
    }

    paintAxis(ctx, ticks) {
      const [v0, v1] = this.view, span = v1 - v0;
      ctx.fillStyle = "#fff";
      ctx.fillRect(0, 0, this.width, AXIS - 4);
      ctx.fillRect(0, 0, GUTTER - 4, AXIS);
      ctx.fillStyle = "#667085";
      ctx.font = "11px system-ui, sans-serif";
      ctx.textAlign = "center";
      ctx.textBaseline = "middle";
      const origin = this.origin / 1e6, p = (n, w) => String(n).padStart(w || 2, "0");
      for (const t of ticks.at) {
        const when = new Date(origin + t);
        let label = p(when.getHours()) + ":" + p(when.getMinutes()) + ":" + p(when.getSeconds());
        if (ticks.step < 1000) label += "." + p(when.getMilliseconds(), 3);
        ctx.fillText(label, this.x(t), AXIS / 2 - 2);
      }
      ctx.textAlign = "left";
      ctx.fillText("span " + fmt(span), 8, AXIS / 2 - 2);
      const now = this.x(this.data.now);
      if (now > GUTTER && now < this.width - RIGHT) {
        ctx.strokeStyle = "#d64545";
        ctx.setLineDash([4, 3]);
        ctx.beginPath(); ctx.moveTo(now, AXIS - 4); ctx.lineTo(now, this.height); ctx.stroke();
        ctx.setLineDash([]);
      }
    }

    /* Per bar, over its phases: a gap at its start (back-to-back requests stay apart), its category
     * as a stripe along its top, a red corner when it missed an objective (--slo), a dark line along
     * its bottom when its category's part was abnormal for its instance (the slowness verdict's
     * test), and its id where the bar is wide enough to hold it. */
    paintMarks(ctx, visible, h) {
      const r = this.data.requests, d = this.data;
      const stripe = Math.max(1, Math.min(3, Math.floor(h / 4)));
      ctx.fillStyle = PANEL;
      ctx.beginPath();
      for (const i of visible) {
        const x0 = this.x(this.start[i]);
        if (this.x(this.end[i]) - x0 >= 4) ctx.rect(x0, this.y(i), 1, h);
      }
      ctx.fill();
      const byCategory = new Map();
      for (const i of visible) {
        const name = d.categories[r.category[i]];
        if (!byCategory.has(name)) byCategory.set(name, []);
        byCategory.get(name).push(i);
      }
      for (const [name, list] of byCategory) {
        ctx.fillStyle = CATEGORY_COLORS[name] || BAD;
        ctx.beginPath();
        for (const i of list) {
          const x0 = this.x(this.start[i]) + 1, x1 = this.x(this.end[i]);
          if (x1 - x0 >= 2) ctx.rect(x0, this.y(i), x1 - x0, stripe);
        }
        ctx.fill();
      }
      let missed = 0, labelled = 0;
      ctx.fillStyle = BAD;
      ctx.beginPath();
      for (const i of visible) {
        if (!r.slo_missed || !r.slo_missed[i]) continue;
        missed++;
        const x0 = Math.max(GUTTER, this.x(this.start[i])), y = this.y(i), s = Math.min(8, h);
        ctx.moveTo(x0, y); ctx.lineTo(x0 + s, y); ctx.lineTo(x0, y + s); ctx.closePath();
      }
      ctx.fill();
      let abnormal = 0;
      ctx.fillStyle = ABNORMAL;
      ctx.beginPath();
      for (const i of visible) {
        if (r.abnormal[i] !== true) continue;
        abnormal++;
        const x0 = Math.max(GUTTER, this.x(this.start[i])), x1 = this.x(this.end[i]), s = Math.min(3, Math.max(1, h / 3));
        ctx.rect(x0, this.y(i) + h - s, Math.max(2, x1 - x0), s);
      }
      ctx.fill();
      this.canvas.dataset.abnormal = String(abnormal);
      if (h >= 10) {
        ctx.font = "10px system-ui, sans-serif";
        ctx.textAlign = "left";
        ctx.textBaseline = "middle";
        ctx.fillStyle = "#1d2330";
        for (const i of visible) {
          const x0 = Math.max(GUTTER, this.x(this.start[i])), x1 = Math.min(this.width - RIGHT, this.x(this.end[i]));
          const id = r.id[i];
          if (x1 - x0 < 24) continue;
          const w = ctx.measureText(id).width;
          if (w + 8 > x1 - x0) continue;
          ctx.fillText(id, x0 + 4, this.y(i) + stripe + (h - stripe) / 2);
          labelled++;
        }
      }
      this.canvas.dataset.labelled = String(labelled);
      this.canvas.dataset.sloMissed = String(missed);
    }

    /* ---- interaction ----------------------------------------------------------------------- */
    hit(px, py) {
      if (!this.data || px < GUTTER) return -1;
      let lane = -1;
      for (let l = 0; l < this.laneTop.length; l++) if (py >= this.laneTop[l]) lane = l;
      if (lane < 0) return -1;
      const row = Math.floor((py - this.laneTop[lane] - MARK) / this.rowH);
      const list = this.rows[lane][row];
      if (!list || py < this.laneTop[lane] + MARK) return -1;
      const t = this.t(px), tol = 3 * (this.view[1] - this.view[0]) / (this.width - GUTTER - RIGHT);
      let lo = 0, hi = list.length - 1, found = -1;
      while (lo <= hi) {  // last request in the row that starts before t + tol
        const mid = (lo + hi) >> 1;
        if (this.start[list[mid]] <= t + tol) { found = mid; lo = mid + 1; } else hi = mid - 1;
      }
      for (let k = found; k >= 0 && k >= found - 1; k--) if (this.end[list[k]] >= t - tol) return list[k];
      return -1;
    }

    /* The lane whose name (in the gutter) was clicked, if it has nodes to open; else -1. */
    toggleAt(px, py) {
      if (!this.data || px >= GUTTER) return -1;
      for (let l = this.laneTop.length - 1; l >= 0; l--) {
        if (py >= this.laneTop[l]) return py <= this.laneTop[l] + MARK + 26 && this.laneNodes[l].length ? l : -1;
      }
      return -1;
    }

    /* The node step under the mouse: its index in data.steps, or -1. */
    stepAt(px, py) {
      if (!this.data || px < GUTTER) return -1;
      const t = this.t(px), tol = 2 * (this.view[1] - this.view[0]) / (this.width - GUTTER - RIGHT);
      for (const lane of this.opened) {
        for (const k of this.laneNodes[lane]) {
          if (py < this.nodeTop[k] || py >= this.nodeTop[k] + NODE_H) continue;
          let lo = this.stepFrom[k], hi = this.stepTo[k];
          while (lo < hi) { const mid = (lo + hi) >> 1; if (this.stepEnd[mid] < t - tol) lo = mid + 1; else hi = mid; }
          return lo < this.stepTo[k] && this.stepStart[lo] <= t + tol ? lo : -1;
        }
      }
      return -1;
    }

    describeStep(i) {
      const d = this.data, st = d.steps, k = st.node[i], step = st.end[i] - st.start[i];
      const rows = [["rank " + d.nodes.rank[k] + " · " + d.nodes.name[k]],
                    ["holds", d.nodes.placement[k] || "n/a"], ["step", fmt(step)]];
      if (st.compute[i] === null) rows.push(["split", "not timed (one step in 8 is)"]);
      else rows.push(["compute", fmt(st.compute[i])], ["waiting on the ring", fmt(st.ring[i])],
                     ["rest of step", fmt(Math.max(0, step - st.compute[i] - (st.ring[i] || 0)))]);
      return rows;
    }

    eviction(px, py) {
      const d = this.data;
      for (let k = 0; k < this.evT.length; k++) {
        const top = this.laneTop[d.evictions.lane[k]];
        if (py >= top && py <= top + MARK && Math.abs(this.x(this.evT[k]) - px) <= 5) return k;
      }
      return -1;
    }

    show(rows, cx, cy) {
      const tip = this.tooltip;
      tip.replaceChildren();
      for (const [k, v] of rows) {
        const line = document.createElement("div");
        if (v === undefined) {
          const b = document.createElement("b");
          b.textContent = k;           // textContent: ids are user text and must never become markup
          line.append(b);
        } else {
          line.className = "row";
          const a = document.createElement("span"), b = document.createElement("span");
          a.textContent = k; b.textContent = v;
          b.dataset.field = k;
          line.append(a, b);
        }
        tip.append(line);
      }
      tip.classList.remove("hidden");
      const w = tip.offsetWidth, h = tip.offsetHeight;
      tip.style.left = Math.min(cx + 14, window.innerWidth - w - 8) + "px";
      tip.style.top = Math.min(cy + 14, window.innerHeight - h - 8) + "px";
    }

    describe(i) {
      const r = this.data.requests, d = this.data;
      const tokens = (v) => (v === null ? "n/a" : v.toLocaleString());
      return [
        [r.id[i]],
        ["instance", d.lanes[r.lane[i]] || "(none)"], ["category", d.categories[r.category[i]]],
        ...(r.slo_missed && r.slo_missed[i] ? [["missed objectives", r.slo_missed[i]]] : []),
        ...(r.samples[i] !== null ? [["abnormal?", abnormalText(d, i)]] : []),
        ["e2e", fmt(r.e2e[i])], ["ttft", fmt(r.ttft[i])], ["tpot", fmt(r.tpot[i])],
        ["load_wait", fmt(r.load_wait[i])], ["queue", fmt(r.queue[i])], ["prefill", fmt(r.prefill[i])],
        ["decode", fmt(r.decode[i])],
        ["prompt tokens", tokens(r.prompt[i])], ["cached tokens", tokens(r.cached[i])],
        ["output tokens", tokens(r.completion[i])],
      ];
    }

    bind() {
      const c = this.canvas;
      let drag = null;
      c.addEventListener("wheel", (e) => {
        e.preventDefault();
        const t = this.t(e.offsetX), f = Math.exp(e.deltaY * 0.0015);
        const span = Math.max(0.01, (this.view[1] - this.view[0]) * f);
        const share = (t - this.view[0]) / (this.view[1] - this.view[0]);
        this.view = [t - share * span, t + (1 - share) * span];
        this.draw();
      }, {passive: false});
      c.addEventListener("mousedown", (e) => { drag = {x: e.clientX, view: this.view.slice(), moved: false}; });
      window.addEventListener("mouseup", () => {
        if (drag && drag.moved) c.classList.remove("dragging");
        setTimeout(() => { drag = null; }, 0);
      });
      c.addEventListener("mousemove", (e) => {
        if (drag && e.buttons === 1) {
          const dx = e.clientX - drag.x;
          if (Math.abs(dx) > 3) { drag.moved = true; c.classList.add("dragging"); }
          const per = (drag.view[1] - drag.view[0]) / (this.width - GUTTER - RIGHT);
          this.view = [drag.view[0] - dx * per, drag.view[1] - dx * per];
          this.tooltip.classList.add("hidden");
          this.draw();
          return;
        }
        const i = this.hit(e.offsetX, e.offsetY);
        if (i !== this.hover) { this.hover = i; this.draw(); }
        if (i >= 0) { c.style.cursor = "pointer"; this.show(this.describe(i), e.clientX, e.clientY); return; }
        if (this.toggleAt(e.offsetX, e.offsetY) >= 0) { c.style.cursor = "pointer"; this.tooltip.classList.add("hidden"); return; }
        const step = this.stepAt(e.offsetX, e.offsetY);
        if (step >= 0) { c.style.cursor = ""; this.show(this.describeStep(step), e.clientX, e.clientY); return; }
        c.style.cursor = "";
        const k = this.eviction(e.offsetX, e.offsetY);
        if (k >= 0) {
          const ev = this.data.evictions;
          this.show([["eviction: " + ev.reason[k]], ["instance", this.data.lanes[ev.lane[k]]],
                     ["tokens", String(ev.tokens[k])], ["bytes", String(ev.bytes[k])],
                     ["entry of", ev.entry_request[k] || "n/a"], ["evicted by", ev.by_request[k] || "n/a"]],
                    e.clientX, e.clientY);
        } else this.tooltip.classList.add("hidden");
      });
      c.addEventListener("mouseleave", () => { this.hover = -1; this.tooltip.classList.add("hidden"); this.draw(); });
      c.addEventListener("click", (e) => {
        if (drag && drag.moved) return;
        const lane = this.toggleAt(e.offsetX, e.offsetY);
        if (lane >= 0 && this.onToggle) { this.onToggle(this.data.lanes[lane]); return; }
        const i = this.hit(e.offsetX, e.offsetY);
        if (i >= 0) location.href = "/requests/" + encodeURIComponent(this.data.requests.id[i]);
      });
      c.addEventListener("dblclick", () => { this.reset(); this.draw(); });
      window.addEventListener("resize", () => { if (this.data) { this.resize(); this.draw(); } });
    }

    zoom(factor) {
      const mid = (this.view[0] + this.view[1]) / 2, half = (this.view[1] - this.view[0]) / 2 * factor;
      this.view = [mid - half, mid + half];
      this.draw();
    }

    /* Centre of request ``id``'s bar in client coordinates (tests move the real mouse there). */
    locate(id) {
      const i = this.data.requests.id.indexOf(id);
      if (i < 0) return null;
      const box = this.canvas.getBoundingClientRect();
      const x0 = Math.max(GUTTER, this.x(this.start[i])), x1 = Math.min(this.width - RIGHT, this.x(this.end[i]));
      return {x: box.left + (x0 + x1) / 2, y: box.top + this.y(i) + this.rowH / 2};
    }
  }

  /* The requests drawn, as a table under the canvas: newest first, sortable by any column (click its
   * header; again: the other way), filtered by a text (id, instance, category, missed objective or
   * the abnormal test), each id a link to its request page. At most TABLE_MAX rows are built. */
  const TABLE_MAX = 500;
  // A request's start as the store's clock shows it (UTC), to the millisecond.
  const clock = (t0ns, ms) => new Date(t0ns / 1e6 + ms).toISOString().slice(11, 23) + " UTC";
  const COLUMNS = [
    ["request", (d, i) => d.requests.id[i], "text"], ["instance", (d, i) => d.lanes[d.requests.lane[i]] || "", "text"],
    ["category", (d, i) => d.categories[d.requests.category[i]], "text"],
    ["start", (d, i) => d.requests.start[i], "clock"], ["e2e", (d, i) => d.requests.e2e[i], "ms"],
    ["ttft", (d, i) => d.requests.ttft[i], "ms"], ["queue", (d, i) => d.requests.queue[i], "ms"],
    ["prefill", (d, i) => d.requests.prefill[i], "ms"], ["decode", (d, i) => d.requests.decode[i], "ms"],
    ["output", (d, i) => d.requests.completion[i], "n"],
    ["missed", (d, i) => (d.requests.slo_missed ? d.requests.slo_missed[i] || "" : ""), "text"],
    ["abnormal", (d, i) => abnormalText(d, i), "text"],
  ];
  const FILTERED = [0, 1, 2, 10, 11];  // the columns the filter reads

  class RequestTable {
    constructor(table, filter, count) {
      this.table = table; this.filter = filter; this.count = count;
      this.sortBy = 3; this.descending = true;  // newest first
      this.data = null;
      const head = table.tHead.rows[0];
      COLUMNS.forEach(([name], k) => {
        const th = document.createElement("th");
        th.textContent = name;
        th.dataset.column = name;
        if (COLUMNS[k][2] !== "text") th.className = "n";
        th.addEventListener("click", () => {
          this.descending = this.sortBy === k ? !this.descending : COLUMNS[k][2] !== "text";
          this.sortBy = k;
          this.render();
        });
        head.append(th);
      });
      filter.addEventListener("input", () => this.render());
    }

    update(data) { this.data = data; this.render(); }

    render() {
      const d = this.data;
      if (!d) return;
      const query = this.filter.value.trim().toLowerCase();
      let rows = Array.from({length: d.requests.id.length}, (_, i) => i);
      if (query) {
        rows = rows.filter((i) => FILTERED.some((k) => String(COLUMNS[k][1](d, i)).toLowerCase().includes(query)));
      }
      const [, value, kind] = COLUMNS[this.sortBy], sign = this.descending ? -1 : 1;
      // (the start column sorts by its number, like every column that is not text)
      rows.sort((a, b) => {
        const x = value(d, a), y = value(d, b);
        if (x === y) return 0;
        if (x === null || x === undefined) return 1;  // unknown last, either way
        if (y === null || y === undefined) return -1;
        return (kind === "text" ? String(x).localeCompare(String(y)) : x - y) * sign;
      });
      const body = this.table.tBodies[0];
      body.replaceChildren();
      for (const i of rows.slice(0, TABLE_MAX)) {
        const tr = document.createElement("tr");
        tr.dataset.request = d.requests.id[i];
        tr.dataset.abnormal = String(d.requests.abnormal[i]);  // true, false or null (not judged)
        COLUMNS.forEach(([name, get, kind]) => {
          const td = document.createElement("td"), v = get(d, i);
          if (name === "request") {
            const a = document.createElement("a");
            a.href = "/requests/" + encodeURIComponent(v);
            a.textContent = v;  // ids are user text: never markup
            td.className = "mono";
            td.append(a);
          } else if (name === "category") {
            const swatch = document.createElement("span");
            swatch.className = "swatch c-" + v;
            td.append(swatch, document.createTextNode(v));
          } else {
            td.textContent = kind === "ms" ? fmt(v) : kind === "clock" ? clock(d.t0_ns, v)
              : v === null || v === undefined ? "n/a" : String(v);
            if (kind !== "text") td.className = "n";
          }
          tr.append(td);
        });
        body.append(tr);
      }
      this.count.textContent = rows.length > TABLE_MAX ? `${rows.length.toLocaleString()} match; the first ` +
        `${TABLE_MAX} in this order shown` : `${rows.length.toLocaleString()} shown`;
      this.table.dataset.rows = String(Math.min(rows.length, TABLE_MAX));
      this.table.dataset.matched = String(rows.length);
    }
  }

  const canvas = document.getElementById("timeline");
  const tl = new Timeline(canvas, document.getElementById("tooltip"), document.getElementById("tl-summary"));
  window.tokentraceTimeline = {timeline: tl, firstDrawMs: null, locate: (id) => tl.locate(id)};
  const table = new RequestTable(document.getElementById("tl-table"), document.getElementById("tl-filter"),
                                 document.getElementById("tl-table-count"));
  window.tokentraceTimeline.table = table;
  const first = JSON.parse(document.getElementById("timeline-data").textContent);
  tl.load(first);
  table.update(first);
  document.getElementById("zoom-in").addEventListener("click", () => tl.zoom(0.5));
  document.getElementById("zoom-out").addEventListener("click", () => tl.zoom(2));
  document.getElementById("zoom-reset").addEventListener("click", () => { tl.reset(); tl.draw(); });
  const refresh = async () => {
    const response = await fetch(canvas.dataset.src, {credentials: "same-origin"});
    if (response.ok) { const data = await response.json(); tl.load(data); table.update(data); }
  };
  document.addEventListener("tokentrace:tick", refresh);
  // Open or close a cluster into its nodes: the twin's and the page's ?open= both change (a reload or
  // a shared link keeps it), then the twin is fetched again.
  tl.onToggle = (name) => {
    const opened = (url) => {
      const open = new Set(url.searchParams.getAll("open"));
      if (open.has(name)) open.delete(name); else open.add(name);
      url.searchParams.delete("open");
      for (const o of open) url.searchParams.append("open", o);
      return url;
    };
    const twin = opened(new URL(canvas.dataset.src, location.href));
    canvas.dataset.src = twin.pathname + twin.search;
    history.replaceState(null, "", opened(new URL(location.href)));
    refresh();
  };
  window.tokentraceTimeline.toggle = (name) => tl.onToggle(name);
})();
