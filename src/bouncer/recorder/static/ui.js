// The flight recorder page: every chart reads the same samples (/admin/timeline), one x axis,
// one cursor synced across them, and a table of the moment under it. No build step: plain
// browser JavaScript over the bundled uPlot.
"use strict";
(() => {
  const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#db2777", "#65a30d",
                   "#7c3aed", "#ca8a04", "#0f766e", "#be123c"];
  const SLO_WINDOW_S = 10; // attainment is over the last 10 s of completions
  const MAX_HELD = 100000;

  const state = {
    header: null, samples: [], view: [], key: null, live: false,
    filters: {band: "", replica: "", hidden: new Set(), windowS: 300},
    known: {tenants: new Map(), bands: new Set(), replicas: new Set(), models: new Set(), outcomes: new Set()},
    // the moment the table shows: under the mouse, else the one pinned by a click, else the latest;
    // kept as a sample's time, so it stays put while live samples slide the window
    charts: [], layoutKey: "", hoverT: null, pinnedT: null, redrawPending: false,
  };
  const ui = window.bouncerUI = {state, errors: [], ready: false, chartData, momentAt, setCursorAt};
  window.addEventListener("error", (e) => ui.errors.push(String(e.message)));

  const $ = (id) => document.getElementById(id);
  const step = () => state.header.step_s;
  const sum = (xs) => xs.reduce((a, b) => a + b, 0);

  // -- loading -------------------------------------------------------------------------------
  function readKey() {
    const m = /(?:^#|&)key=([^&]+)/.exec(location.hash);
    if (m) {
      sessionStorage.setItem("bouncer-key", decodeURIComponent(m[1]));
      history.replaceState(null, "", location.pathname + location.search);
    }
    state.key = sessionStorage.getItem("bouncer-key");
  }

  function headers() {
    return state.key ? {Authorization: "Bearer " + state.key} : {};
  }

  async function load() {
    const resp = await fetch("/admin/timeline", {headers: headers()});
    if (resp.status === 401 || resp.status === 403) {
      askForKey(resp.status === 401 && state.key ? "that key is not allowed here" : "");
      return;
    }
    if (!resp.ok) {
      setStatus(`/admin/timeline answered ${resp.status}: ${(await resp.text()).slice(0, 200)}`, true);
      return;
    }
    const body = await resp.json();
    state.header = body.header;
    state.live = state.header.clock === "wall" && state.header.live !== false;
    $("source").textContent = `${state.header.source} · step ${state.header.step_s} s` +
      (state.live ? " · live" : ` · recorded (${state.header.clock} time)`);
    if (!state.live) {
      state.filters.windowS = 0;
      $("window").value = "0";
    }
    addSamples(body.samples);
    ui.ready = true;
    if (state.live) stream();
  }

  function askForKey(message) {
    $("login").hidden = false;
    $("login-error").textContent = message;
    $("login").onsubmit = (e) => {
      e.preventDefault();
      sessionStorage.setItem("bouncer-key", $("key").value);
      state.key = $("key").value;
      $("login").hidden = true;
      load();
    };
  }

  async function stream() {
    for (;;) {
      try {
        const last = state.samples.length ? state.samples[state.samples.length - 1].t : null;
        const url = "/admin/timeline?stream=1" + (last === null ? "" : `&since=${last + 0.0005}`);
        const resp = await fetch(url, {headers: headers()});
        if (!resp.ok) throw new Error(`answered ${resp.status}`);
        setStatus("streaming");
        const reader = resp.body.getReader();
        const decoder = new TextDecoder();
        let buffer = "";
        for (;;) {
          const {value, done} = await reader.read();
          if (done) break;
          buffer += decoder.decode(value, {stream: true});
          let end;
          while ((end = buffer.indexOf("\n\n")) >= 0) {
            onEvent(buffer.slice(0, end));
            buffer = buffer.slice(end + 2);
          }
        }
        setStatus("stream ended; reconnecting");
      } catch (err) {
        setStatus(`stream lost (${err.message}); reconnecting`);
      }
      await new Promise((r) => setTimeout(r, 1000));
    }
  }

  function onEvent(text) {
    let event = "message";
    let data = "";
    for (const line of text.split("\n")) {
      if (line.startsWith("event:")) event = line.slice(6).trim();
      else if (line.startsWith("data:")) data += line.slice(5).trim();
    }
    if (event === "message" && data) addSamples([JSON.parse(data)]);
  }

  function setStatus(text, isError = false) {
    $("status").textContent = text;
    $("status").className = isError ? "error" : "muted";
  }

  // -- samples -------------------------------------------------------------------------------
  function addSamples(samples) {
    for (const s of samples) {
      state.samples.push(s);
      learn(s);
    }
    if (state.samples.length > MAX_HELD) state.samples.splice(0, state.samples.length - MAX_HELD);
    scheduleRedraw();
  }

  function learn(s) {
    const k = state.known;
    for (const [tenant, g] of Object.entries(s.gauges.tenants)) k.tenants.set(tenant, g.band ?? null);
    for (const [tenant, c] of Object.entries(s.counts.tenants)) {
      if (!k.tenants.has(tenant)) k.tenants.set(tenant, null);
      for (const key of Object.keys(c)) if (key.includes(":")) k.outcomes.add(key);
    }
    for (const [model, m] of Object.entries(s.gauges.models)) {
      k.models.add(model);
      for (const band of Object.keys(m.bands)) k.bands.add(band);
      for (const r of Object.keys(m.replicas)) k.replicas.add(r);
    }
    for (const band of k.tenants.values()) if (band !== null) k.bands.add(String(band));
  }

  function visibleTenants() {
    const out = [];
    for (const [tenant, band] of state.known.tenants) {
      if (state.filters.hidden.has(tenant)) continue;
      if (state.filters.band !== "" && String(band) !== state.filters.band) continue;
      out.push(tenant);
    }
    return out.sort();
  }
  const visibleBands = () => [...state.known.bands].filter((b) => state.filters.band === "" || b === state.filters.band)
    .sort((a, b) => Number(b) - Number(a));
  const visibleReplicas = () => [...state.known.replicas]
    .filter((r) => state.filters.replica === "" || r === state.filters.replica).sort();
  const tenantLabel = (t) => state.known.tenants.get(t) === null ? t : `${t} (band ${state.known.tenants.get(t)})`;

  function bandGauge(s, band, field) {
    let total = 0;
    for (const m of Object.values(s.gauges.models)) {
      const b = m.bands[band];
      if (b) total = field === "oldest_wait_s" ? Math.max(total, b[field]) : total + b[field];
    }
    return total;
  }

  function replicaGauge(s, replica, field) {
    for (const m of Object.values(s.gauges.models)) {
      if (m.replicas[replica]) return m.replicas[replica][field];
    }
    return null;
  }

  function rollingSlo(idx, tenant) {
    const n = Math.max(1, Math.round(SLO_WINDOW_S / step()));
    let met = 0;
    let total = 0;
    for (let i = Math.max(0, idx - n + 1); i <= idx; i++) {
      const c = state.view[i].counts.tenants[tenant];
      if (c) {
        met += c.slo_met || 0;
        total += c.slo_total || 0;
      }
    }
    return total ? met / total : null;
  }

  // -- charts: each a title, a unit and its series, each series a value per sample --------------
  function chartSpecs() {
    const tenants = visibleTenants();
    const bands = visibleBands();
    const replicas = visibleReplicas();
    const rate = (n) => n / step();
    const count = (s, key) => sum(tenants.map((t) => (s.counts.tenants[t] || {})[key] || 0));
    const outcomes = [...state.known.outcomes].sort();
    return [
      {id: "traffic", title: "Client traffic: arrivals by tenant", unit: "req/s",
       series: tenants.map((t) => ({label: tenantLabel(t), get: (s) => rate((s.counts.tenants[t] || {}).arrived || 0)}))},
      {id: "decisions", title: "Decisions: dispatched, completed, and every refusal or end by reason", unit: "req/s",
       series: [
         {label: "admitted", get: (s) => rate(count(s, "admitted"))},
         {label: "completed", get: (s) => rate(count(s, "completed"))},
         ...outcomes.map((key) => ({label: key, get: (s) => rate(count(s, key)), dash: true})),
       ]},
      {id: "queue", title: "Gateway queue by band", unit: "requests",
       series: bands.map((b) => ({label: `band ${b}`, get: (s) => bandGauge(s, b, "queued")}))},
      {id: "wait", title: "Oldest queued request's wait by band", unit: "s",
       series: bands.map((b) => ({label: `band ${b}`, get: (s) => bandGauge(s, b, "oldest_wait_s")}))},
      {id: "pressure", title: "Engine pressure: KV usage per replica (scraped; dashed: with the gateway's own " +
         "in-flight), pool saturation", unit: "fraction",
       series: [
         ...replicas.flatMap((r) => [
           {label: `${r} kv`, get: (s) => replicaGauge(s, r, "kv_usage")},
           {label: `${r} projected`, get: (s) => replicaGauge(s, r, "projected_kv_usage"), dash: true},
         ]),
         ...[...state.known.models].sort().map((m) => ({label: `${m} saturation`,
           get: (s) => (s.gauges.models[m] || {}).saturation ?? null, width: 2})),
       ]},
      {id: "engine", title: "Engine queues per replica: running (dashed: waiting)", unit: "requests",
       series: replicas.flatMap((r) => [
         {label: `${r} running`, get: (s) => replicaGauge(s, r, "running")},
         {label: `${r} waiting`, get: (s) => replicaGauge(s, r, "waiting"), dash: true},
       ])},
      {id: "slo", title: `SLO attainment by tenant (completions in the last ${SLO_WINDOW_S} s, TTFT from the ` +
         "attempt's arrival)", unit: "share", range: [0, 1.05],
       series: tenants.map((t) => ({label: tenantLabel(t), get: (_s, i) => rollingSlo(i, t)}))},
    ];
  }

  function chartData(id) {
    const spec = chartSpecs().find((c) => c.id === id);
    if (!spec) return null;
    return {labels: spec.series.map((s) => s.label), x: state.view.map((s) => s.t),
            series: spec.series.map((s) => state.view.map((sample, i) => s.get(sample, i)))};
  }

  function windowed() {
    const all = state.samples;
    if (!state.filters.windowS || !all.length) return all;
    const from = all[all.length - 1].t - state.filters.windowS;
    let lo = 0;
    while (lo < all.length && all[lo].t < from) lo++;
    return all.slice(lo);
  }

  function scheduleRedraw() {
    if (state.redrawPending) return;
    state.redrawPending = true;
    requestAnimationFrame(() => {
      state.redrawPending = false;
      redraw();
    });
  }

  function redraw() {
    state.view = windowed();
    syncFilters();
    const specs = chartSpecs();
    const layoutKey = JSON.stringify(specs.map((c) => [c.id, c.series.map((s) => s.label)]));
    if (layoutKey !== state.layoutKey) build(specs, layoutKey);
    const xs = state.view.map((s) => s.t);
    specs.forEach((spec, n) => {
      const data = [xs, ...spec.series.map((s) => state.view.map((sample, i) => s.get(sample, i)))];
      state.charts[n].setData(data);
    });
    placeCursor();
    renderMoment();
  }

  function momentT() {
    return state.hoverT ?? state.pinnedT;
  }

  // the sample index at time t (the nearest), or null for none
  function indexAt(t) {
    if (t === null || !state.view.length) return null;
    let lo = 0;
    let hi = state.view.length - 1;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (state.view[mid].t < t) lo = mid + 1;
      else hi = mid;
    }
    if (lo > 0 && Math.abs(state.view[lo - 1].t - t) < Math.abs(state.view[lo].t - t)) lo--;
    return lo;
  }

  // draws the one cursor (synced across charts) at the moment the table shows
  function placeCursor() {
    const t = momentT();
    if (t === null || !state.charts.length || !state.view.length) return;
    const x = state.view[indexAt(t)].t;
    // after uPlot has laid out the data just set (it commits in a microtask)
    requestAnimationFrame(() => {
      for (const u of state.charts) u.setCursor({left: u.valToPos(x, "x"), top: u.over.clientHeight / 2}, false);
    });
  }

  function build(specs, layoutKey) {
    for (const c of state.charts) c.destroy();
    state.charts = [];
    const holder = $("charts");
    holder.innerHTML = "";
    const width = Math.max(400, holder.clientWidth - 4);
    const timeAxis = state.header.clock === "wall";
    for (const spec of specs) {
      const box = document.createElement("section");
      box.className = "chart";
      box.id = `chart-${spec.id}`;
      const title = document.createElement("h3");
      title.textContent = spec.title;
      box.appendChild(title);
      holder.appendChild(box);
      const opts = {
        width, height: 150,
        cursor: {sync: {key: "bouncer", setSeries: false}, drag: {x: false, y: false}, y: false},
        scales: {x: {time: timeAxis}, ...(spec.range ? {y: {range: spec.range}} : {})},
        legend: {live: false},
        axes: [
          timeAxis ? {} : {values: (_u, ticks) => ticks.map((t) => `${t.toFixed(0)} s`)},
          {label: spec.unit, size: 60},
        ],
        series: [{}, ...spec.series.map((s, i) => ({
          label: s.label, stroke: PALETTE[i % PALETTE.length], width: s.width || 1.5,
          dash: s.dash ? [5, 4] : undefined, points: {show: false}, spanGaps: false,
        }))],
      };
      const u = new uPlot(opts, [[]].concat(spec.series.map(() => [])), box);
      // the mouse, not uPlot's cursor events (setData fires those too), says which moment is read
      u.over.addEventListener("mousemove", (e) => {
        const i = u.posToIdx(e.offsetX);
        if (i !== null && i >= 0 && i < state.view.length) {
          state.hoverT = state.view[i].t;
          renderMoment();
        }
      });
      u.over.addEventListener("mouseleave", () => {
        state.hoverT = null;
        placeCursor();
        renderMoment();
      });
      u.over.addEventListener("click", () => {
        state.pinnedT = state.pinnedT === state.hoverT ? null : state.hoverT;
        renderMoment();
      });
      state.charts.push(u);
    }
    state.layoutKey = layoutKey;
  }

  // Pins the moment nearest time t (for a link, or a test, to read a moment); returns its time.
  function setCursorAt(t) {
    const i = indexAt(t);
    if (i === null) return null;
    state.pinnedT = state.view[i].t;
    placeCursor();
    renderMoment();
    return state.pinnedT;
  }

  // -- the moment under the cursor -------------------------------------------------------------
  function momentAt(idx) {
    if (!state.view.length) return null;
    const i = idx === null || idx === undefined ? state.view.length - 1 : idx;
    const s = state.view[i];
    const tenants = {};
    for (const t of visibleTenants()) {
      const c = s.counts.tenants[t] || {};
      const g = s.gauges.tenants[t] || {};
      const ends = Object.entries(c).filter(([k]) => k.includes(":"));
      tenants[t] = {band: state.known.tenants.get(t), arrived: rate(c.arrived), admitted: rate(c.admitted),
                    completed: rate(c.completed), ended: Object.fromEntries(ends.map(([k, v]) => [k, rate(v)])),
                    queued: g.queued ?? 0, oldest_wait_s: g.oldest_wait_s ?? 0, slo: rollingSlo(i, t)};
    }
    const bands = {};
    const replicas = {};
    for (const [model, m] of Object.entries(s.gauges.models)) {
      for (const [b, band] of Object.entries(m.bands)) {
        if (state.filters.band === "" || b === state.filters.band) bands[`${model} ${b}`] = {saturation: m.saturation, ...band};
      }
      for (const [r, rep] of Object.entries(m.replicas)) {
        if (state.filters.replica === "" || r === state.filters.replica) replicas[r] = rep;
      }
    }
    return {index: i, t: s.t, tenants, bands, replicas};
  }

  function rate(n) {
    return (n || 0) / step();
  }

  const fmt = (v, digits = 2) => v === null || v === undefined ? "–" :
    typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toFixed(digits)) : String(v);

  // names (tenants, replicas found by discovery, reasons) are text, never markup
  const ESCAPES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"};
  const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ESCAPES[c]);

  function table(caption, cols, rows) {
    const head = cols.map((c) => `<th>${esc(c[1])}</th>`).join("");
    const body = rows.map(([name, row, cls]) => `<tr class="${esc(cls || "")}"><td>${esc(name)}</td>` +
      cols.slice(1).map(([k]) => `<td data-k="${esc(k)}">${esc(fmt(row[k]))}</td>`).join("") + "</tr>").join("");
    return `<table data-table="${esc(caption)}"><caption>${esc(caption)}</caption><tr>${head}</tr>${body}</table>`;
  }

  function renderMoment() {
    const idx = indexAt(momentT());
    const m = momentAt(idx);
    if (!m) return;
    $("cursor-time").textContent = idx === null ? `the latest sample (${timeLabel(m.t)})` :
      timeLabel(m.t) + (state.hoverT === null ? " (pinned: click the chart again to let go)" : "");
    $("moment").dataset.t = String(m.t);
    const tenantRows = Object.entries(m.tenants).map(([t, r]) => [t, r]);
    const endRows = Object.entries(m.tenants).flatMap(([t, r]) =>
      Object.entries(r.ended).map(([key, perS]) => [`${t} ${key}`, {per_s: perS}]));
    $("moment").innerHTML =
      table("tenants", [["", "tenant"], ["band", "band"], ["arrived", "arrived/s"], ["admitted", "admitted/s"],
        ["completed", "done/s"], ["queued", "queued"], ["oldest_wait_s", "wait s"], ["slo", "SLO"]], tenantRows) +
      table("refused and ended", [["", "tenant outcome:reason"], ["per_s", "per s"]],
        endRows.length ? endRows : [["none in this step", {}]]) +
      table("bands", [["", "model band"], ["queued", "queued"], ["tokens", "tokens"], ["oldest_wait_s", "wait s"],
        ["ceiling", "ceiling"], ["saturation", "saturation"], ["ttft_margin", "TTFT margin"]],
        Object.entries(m.bands).map(([b, r]) => [b, r])) +
      table("replicas", [["", "replica"], ["kv_usage", "kv"], ["projected_kv_usage", "projected"],
        ["running", "running"], ["waiting", "waiting"], ["inflight", "ours"], ["telemetry_age_s", "age s"],
        ["busy", "busy"], ["ttft_factor", "ttft x"], ["tpot_factor", "tpot x"]],
        Object.entries(m.replicas).map(([r, row]) => [r, row, row.busy ? "busy" : ""]));
  }

  function timeLabel(t) {
    return state.header.clock === "wall" ? new Date(t * 1000).toLocaleTimeString() + `.${String(Math.round((t % 1) * 1000)).padStart(3, "0")}`
      : `${t.toFixed(2)} s`;
  }

  // -- filters ----------------------------------------------------------------------------------
  function syncFilters() {
    const fill = (select, values) => {
      const have = new Set([...select.options].map((o) => o.value));
      for (const v of values) {
        if (!have.has(v)) select.add(new Option(v, v));
      }
    };
    fill($("band"), [...state.known.bands].sort((a, b) => Number(b) - Number(a)));
    fill($("replica"), [...state.known.replicas].sort());
    const holder = $("tenants");
    for (const tenant of [...state.known.tenants.keys()].sort()) {
      if (holder.querySelector(`input[value="${CSS.escape(tenant)}"]`)) continue;
      const label = document.createElement("label");
      label.className = "tenant";
      const box = document.createElement("input");
      box.type = "checkbox";
      box.checked = true;
      box.value = tenant;
      label.append(box, ` ${tenant}`);
      box.onchange = (e) => {
        if (e.target.checked) state.filters.hidden.delete(tenant);
        else state.filters.hidden.add(tenant);
        scheduleRedraw();
      };
      holder.appendChild(label);
    }
  }

  $("band").onchange = (e) => { state.filters.band = e.target.value; scheduleRedraw(); };
  $("replica").onchange = (e) => { state.filters.replica = e.target.value; scheduleRedraw(); };
  $("window").onchange = (e) => { state.filters.windowS = Number(e.target.value); scheduleRedraw(); };
  window.addEventListener("resize", () => { state.layoutKey = ""; scheduleRedraw(); });

  readKey();
  load().catch((err) => {
    ui.errors.push(String(err));
    setStatus(`could not load the timeline: ${err.message}`, true);
  });
})();
