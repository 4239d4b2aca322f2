// rollarc's dashboard: a single page over the job API (no framework, no build step). Charts
// are hand-drawn SVG. Live updates come from the job's event stream, read with fetch so the
// access token travels in the Authorization header, resumed with Last-Event-ID.
'use strict';

const TERMINAL = ['succeeded', 'failed', 'cancelled'];
const COLORS = ['#2563eb', '#dc2626', '#059669', '#d97706', '#7c3aed', '#0891b2', '#db2777', '#4b5563'];
const $ = (sel, root = document) => root.querySelector(sel);

let token = localStorage.getItem('rollarc.token') || '';
let page = null; // the open page; `close()` stops its timers and streams

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith('on')) e.addEventListener(k.slice(2), v);
    else if (k === 'text') e.textContent = v;
    else e.setAttribute(k, v === true ? '' : v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function banner(msg) {
  const b = $('#banner');
  b.hidden = !msg;
  b.textContent = msg || '';
}

class Unauthorized extends Error {}

async function api(path, opts = {}) {
  const headers = Object.assign({}, opts.headers || {});
  if (token) headers.Authorization = 'Bearer ' + token;
  const r = await fetch(path, Object.assign({}, opts, { headers }));
  if (r.status === 401) {
    banner('The service needs an access token: enter one above.');
    throw new Unauthorized('unauthorized');
  }
  if (!r.ok) {
    let msg = r.status + ' ' + r.statusText;
    try {
      const b = await r.json();
      if (b.error && b.error.message) msg = b.error.message;
    } catch (_) { /* not JSON */ }
    const e = new Error(msg);
    e.status = r.status;
    throw e;
  }
  return r;
}
const getJson = async (path) => (await api(path)).json();

// ---- formatting -------------------------------------------------------------------------

function fmt(v, digits = 3) {
  if (v === null || v === undefined || Number.isNaN(v)) return '–';
  if (typeof v !== 'number') return String(v);
  if (Number.isInteger(v) && Math.abs(v) < 1e6) return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(2);
  return v.toFixed(a >= 100 ? 1 : digits);
}
function duration(s) {
  if (s === null || s === undefined) return '–';
  if (s < 60) return s.toFixed(1) + ' s';
  if (s < 3600) return Math.floor(s / 60) + ' min ' + Math.round(s % 60) + ' s';
  return (s / 3600).toFixed(1) + ' h';
}
function stateBadge(state) { return el('span', { class: 'state ' + state, 'data-state': state }, state); }
function progressBar(step, steps) {
  const f = steps > 0 ? Math.min(1, step / steps) : 0;
  const b = el('div', { class: 'bar', title: `${step} / ${steps}` });
  const i = el('i');
  i.style.width = (100 * f).toFixed(1) + '%';
  b.append(i);
  return b;
}

// ---- charts -----------------------------------------------------------------------------

const SVGNS = 'http://www.w3.org/2000/svg';
function svg(tag, attrs = {}, text) {
  const e = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function niceTicks(lo, hi, n = 5) {
  if (!(hi > lo)) { hi = lo + 1; }
  const raw = (hi - lo) / n;
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
  const out = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(+t.toPrecision(12));
  return out;
}

// Trailing mean over `w` points (w <= 1: the raw series).
function smooth(points, w) {
  if (w <= 1) return points;
  const out = [];
  let sum = 0;
  for (let i = 0; i < points.length; i++) {
    sum += points[i][1];
    if (i >= w) sum -= points[i - w][1];
    out.push([points[i][0], sum / Math.min(i + 1, w)]);
  }
  return out;
}

// A line chart. series: [{name, points: [[x, y]], color, dash, faint, marks, err}]
function lineChart(title, series, opts = {}) {
  const box = el('div', { class: 'card chart', 'data-chart': title });
  box.append(el('h3', {}, title));
  const all = series.flatMap((s) => s.points.map((p) => [p[0], p[1], s.err ? s.err[p[0]] || 0 : 0]));
  if (!all.length) {
    box.append(el('div', { class: 'empty' }, opts.empty || 'no data yet'));
    return box;
  }
  const W = 520, H = 210, L = 48, R = 10, T = 8, B = 24;
  let xlo = Math.min(...all.map((p) => p[0])), xhi = Math.max(...all.map((p) => p[0]));
  if (opts.xmin !== undefined) xlo = Math.min(xlo, opts.xmin);
  let ylo = Math.min(...all.map((p) => p[1] - p[2])), yhi = Math.max(...all.map((p) => p[1] + p[2]));
  if (opts.ymin !== undefined) ylo = Math.min(ylo, opts.ymin);
  if (opts.ymax !== undefined) yhi = Math.max(yhi, opts.ymax);
  if (xhi === xlo) { xhi = xlo + 1; }
  if (yhi === ylo) {
    const d = Math.abs(yhi) * 0.1 || 1;
    if (opts.ymin === undefined || ylo > opts.ymin) ylo -= d;
    yhi += d;
  }
  const pad = (yhi - ylo) * 0.04;
  if (opts.ymin === undefined) ylo -= pad;
  yhi += pad;
  const X = (x) => L + (W - L - R) * (x - xlo) / (xhi - xlo);
  const Y = (y) => T + (H - T - B) * (1 - (y - ylo) / (yhi - ylo));
  const s = svg('svg', { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: 'none', role: 'img' });
  for (const t of niceTicks(ylo, yhi, 4)) {
    s.append(svg('line', { class: 'gridline', x1: L, x2: W - R, y1: Y(t), y2: Y(t) }));
    s.append(svg('text', { x: L - 4, y: Y(t) + 4, 'text-anchor': 'end' }, fmt(t, 2)));
  }
  for (const t of niceTicks(xlo, xhi, 6)) {
    if (opts.integerX && !Number.isInteger(t)) continue;
    s.append(svg('text', { x: X(t), y: H - 6, 'text-anchor': 'middle' }, fmt(t, 1)));
  }
  s.append(svg('line', { class: 'axis', x1: L, x2: L, y1: T, y2: H - B }));
  s.append(svg('line', { class: 'axis', x1: L, x2: W - R, y1: H - B, y2: H - B }));
  for (const se of series) {
    if (!se.points.length) continue;
    const attrs = {
      fill: 'none', stroke: se.color, 'stroke-width': se.faint ? 1 : 1.8,
      'stroke-opacity': se.faint ? 0.3 : 1, 'vector-effect': 'non-scaling-stroke',
      'data-series': se.name, 'data-points': se.points.length,
    };
    if (se.dash) attrs['stroke-dasharray'] = '5 4';
    if (se.marks) {
      const g = svg('g', { 'data-series': se.name, 'data-points': se.points.length });
      for (const [x, y] of se.points) {
        const e = se.err ? se.err[x] || 0 : 0;
        if (e > 0) g.append(svg('line', { x1: X(x), x2: X(x), y1: Y(y - e), y2: Y(y + e), stroke: se.color, 'stroke-width': 1.2 }));
        g.append(svg('circle', { cx: X(x), cy: Y(y), r: 3, fill: se.color }));
      }
      if (se.points.length > 1) {
        attrs['stroke-opacity'] = 0.5;
        g.append(svg('path', Object.assign(attrs, { d: 'M' + se.points.map((p) => X(p[0]).toFixed(1) + ',' + Y(p[1]).toFixed(1)).join('L') })));
      }
      s.append(g);
    } else {
      const d = se.points.length === 1
        ? `M${X(se.points[0][0]) - 2},${Y(se.points[0][1])}h4`
        : 'M' + se.points.map((p) => X(p[0]).toFixed(1) + ',' + Y(p[1]).toFixed(1)).join('L');
      s.append(svg('path', Object.assign(attrs, { d })));
    }
  }
  box.append(s);
  const legend = el('div', { class: 'legend' });
  for (const se of series) {
    if (se.faint || se.hideLegend) continue;
    const sw = el('i');
    sw.style.background = se.color;
    if (se.dash) sw.style.background = `repeating-linear-gradient(90deg, ${se.color} 0 5px, transparent 5px 9px)`;
    const last = se.points.length ? se.points[se.points.length - 1][1] : null;
    legend.append(el('span', {}, sw, se.name + (last !== null && !se.dash ? ' ' + fmt(last) : '')));
  }
  box.append(legend);
  return box;
}

// ---- routing ----------------------------------------------------------------------------

function route() {
  if (page) page.close();
  page = null;
  banner('');
  const m = location.hash.match(/^#\/jobs\/([^/]+)/);
  page = m ? new JobPage(decodeURIComponent(m[1])) : new JobList();
  page.open().catch(showError);
}

function showError(e) {
  if (e instanceof Unauthorized) return;
  $('#main').replaceChildren(el('p', { class: 'error' }, String(e.message || e)));
}

// ---- job list ---------------------------------------------------------------------------

class JobList {
  constructor() { this.timer = null; }
  close() { clearTimeout(this.timer); }
  async open() {
    $('#crumbs').replaceChildren('jobs');
    await this.refresh();
  }
  async refresh() {
    let jobs;
    try {
      jobs = (await getJson('/v1/jobs')).jobs;
    } catch (e) {
      showError(e);
      return;
    }
    jobs.sort((a, b) => b.created_at_ms - a.created_at_ms);
    const rows = jobs.map((j) => {
      const m = j.metrics || {};
      return el('tr', { class: 'click', 'data-job': j.id, onclick: () => { location.hash = '#/jobs/' + encodeURIComponent(j.id); } },
        el('td', {}, el('a', { href: '#/jobs/' + encodeURIComponent(j.id) }, j.id)),
        el('td', {}, j.name || ''),
        el('td', {}, stateBadge(j.state)),
        el('td', {}, progressBar(j.step, j.steps)),
        el('td', { class: 'num' }, `${j.step} / ${j.steps}`),
        el('td', { class: 'num' }, fmt(m.success_rate)),
        el('td', { class: 'num' }, fmt(m.mean_reward)),
        el('td', {}, new Date(j.created_at_ms).toLocaleString()),
        el('td', { class: 'error' }, j.error || ''));
    });
    const table = el('table', { id: 'jobs' },
      el('thead', {}, el('tr', {}, ['job', 'name', 'state', 'progress', 'steps', 'success', 'reward', 'submitted', 'error'].map((h) => el('th', {}, h)))),
      el('tbody', {}, rows));
    $('#main').replaceChildren(el('h1', {}, 'Jobs'),
      jobs.length ? table : el('p', { class: 'muted' }, 'No jobs yet: submit one with `rollarc submit FILE` or POST /v1/jobs.'));
    // Keep polling while anything may still change.
    if (jobs.some((j) => !TERMINAL.includes(j.state)) || !jobs.length) {
      this.timer = setTimeout(() => this.refresh(), 2000);
    }
  }
}

// ---- job page ---------------------------------------------------------------------------

class JobPage {
  constructor(id) {
    this.id = id;
    this.base = '/v1/jobs/' + encodeURIComponent(id);
    this.steps = new Map(); // step -> metrics
    this.timeline = new Map(); // step -> {resource: busy}
    this.expanded = new Set();
    this.smoothing = 5;
    this.abort = new AbortController();
    this.timers = [];
    this.renderQueued = false;
    this.traj = { after: 0, rows: [], next: 0, text: true, selected: null };
    this.lastTimelineFetch = 0;
    this.confirmCancel = false;
  }
  close() {
    this.abort.abort();
    this.timers.forEach(clearTimeout);
  }
  async open() {
    $('#crumbs').replaceChildren(el('a', { href: '#/' }, 'jobs'), ' / ', this.id);
    this.job = await getJson(this.base);
    const [spec, baselines] = await Promise.all([
      getJson(this.base + '/spec').catch(() => null),
      getJson(this.base + '/baselines').catch(() => ({ tasks: {} })),
    ]);
    this.spec = spec;
    this.baselines = baselines.tasks || {};
    this.layout();
    const eventId = await this.loadSteps();
    this.render();
    this.loadTrajectories('newest').catch(showError);
    this.pollFunctions();
    if (!TERMINAL.includes(this.job.state)) this.follow(eventId);
  }

  // The whole history, page by page; the first page's event id is where the stream resumes.
  async loadSteps() {
    let after = 0, eventId = null;
    for (;;) {
      const p = await getJson(`${this.base}/steps?after=${after}&limit=1000`);
      if (eventId === null) eventId = p.event_id;
      for (const r of p.steps) {
        this.steps.set(r.step, r.metrics);
        if (r.metrics.timeline) this.timeline.set(r.step, r.metrics.timeline);
      }
      if (p.steps.length < 1000) break;
      after = p.steps[p.steps.length - 1].step;
    }
    return eventId;
  }

  async loadTimeline() {
    const known = [...this.timeline.keys()];
    const after = known.length ? Math.max(...known) : 0;
    const p = await getJson(`${this.base}/steps?after=${after}&limit=1000`);
    for (const r of p.steps) {
      if (!this.steps.has(r.step)) this.steps.set(r.step, r.metrics);
      if (r.metrics.timeline) this.timeline.set(r.step, r.metrics.timeline);
    }
  }

  // Follows the event stream, reconnecting with the last id seen until a terminal state.
  async follow(lastId) {
    let delay = 500;
    while (!this.abort.signal.aborted) {
      try {
        const headers = { Accept: 'text/event-stream' };
        if (lastId) headers['Last-Event-ID'] = lastId;
        const r = await api(this.base + '/events', { headers, signal: this.abort.signal });
        const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
        let buf = '';
        delay = 500;
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buf += value;
          let i;
          while ((i = buf.indexOf('\n\n')) >= 0) {
            const chunk = buf.slice(0, i);
            buf = buf.slice(i + 2);
            const ev = { event: 'message', data: '', id: null };
            for (const line of chunk.split('\n')) {
              const c = line.indexOf(':');
              if (c <= 0) continue;
              const k = line.slice(0, c), v = line.slice(c + 1).replace(/^ /, '');
              if (k === 'event') ev.event = v; else if (k === 'data') ev.data += v; else if (k === 'id') ev.id = v;
            }
            if (ev.id) lastId = ev.id;
            if (this.onEvent(ev)) return;
          }
        }
      } catch (e) {
        if (this.abort.signal.aborted || e instanceof Unauthorized) return;
      }
      await new Promise((res) => this.timers.push(setTimeout(res, delay)));
      delay = Math.min(delay * 2, 10000);
    }
  }

  // Applies one event; true once the job reached a terminal state.
  onEvent(ev) {
    if (!ev.data) return false;
    let d;
    try { d = JSON.parse(ev.data); } catch (_) { return false; }
    if (ev.event === 'progress') {
      this.steps.set(d.step, d.metrics);
      this.job.step = Math.max(this.job.step, d.step);
      this.job.metrics = d.metrics;
      if (this.job.state === 'queued') this.job.state = 'running';
      const now = Date.now();
      if (now - this.lastTimelineFetch > 2000) {
        this.lastTimelineFetch = now;
        this.loadTimeline().then(() => this.queueRender()).catch(() => {});
      }
      this.queueRender();
    } else if (ev.event === 'state') {
      this.job.state = d.state;
      this.job.step = d.step;
      this.job.error = d.error;
      this.queueRender();
      if (TERMINAL.includes(d.state)) {
        this.loadTimeline().then(() => this.queueRender()).catch(() => {});
        this.loadTrajectories('newest').catch(() => {});
        return true;
      }
    } else if (ev.event === 'weights_installed') {
      this.job.installed = d.version;
      this.queueRender();
    }
    return false;
  }

  queueRender() {
    if (this.renderQueued) return;
    this.renderQueued = true;
    requestAnimationFrame(() => { this.renderQueued = false; this.render(); });
  }

  layout() {
    const main = $('#main');
    main.replaceChildren(
      el('div', { id: 'head' }),
      el('div', { class: 'sections' },
        ['curves', 'trainer', 'system', 'resources', 'functions', 'trajectories', 'spec'].map((s) => el('a', { href: '#', onclick: (e) => { e.preventDefault(); $('#' + s).scrollIntoView(); } }, s))),
      el('h2', { id: 'curves' }, 'Learning curves'),
      el('div', { class: 'controls' }, 'smoothing',
        el('select', { id: 'smoothing', onchange: (e) => { this.smoothing = +e.target.value; this.render(); } },
          [1, 5, 10, 25].map((w) => el('option', { value: w, selected: w === this.smoothing }, w === 1 ? 'none' : `trailing ${w}-step mean`)))),
      el('div', { class: 'grid', id: 'curve-grid' }),
      el('h2', { id: 'trainer' }, 'Trainer'),
      el('div', { class: 'grid', id: 'trainer-grid' }),
      el('h2', { id: 'system' }, 'Throughput, bubbles and staleness'),
      el('div', { class: 'grid', id: 'system-grid' }),
      el('h2', { id: 'resources' }, 'Utilisation timeline'),
      el('p', { class: 'muted' }, 'Busy fraction per step. Rows are per pool, task environment and function deployment; click a row for its members.'),
      el('div', { class: 'card timeline', id: 'timeline' }),
      el('h2', { id: 'functions' }, 'Function deployments'),
      el('div', { id: 'fn' }, el('p', { class: 'muted' }, 'loading…')),
      el('h2', { id: 'trajectories' }, 'Trajectories'),
      el('div', { class: 'split' },
        el('div', {},
          el('div', { class: 'controls' },
            el('button', { id: 'traj-newest', onclick: () => this.loadTrajectories('newest') }, 'newest'),
            el('button', { id: 'traj-first', onclick: () => this.loadTrajectories('first') }, 'oldest'),
            el('button', { id: 'traj-next', onclick: () => this.loadTrajectories('next') }, 'next page ›'),
            el('span', { class: 'muted', id: 'traj-info' })),
          el('div', { class: 'scroll card', id: 'traj-list' })),
        el('div', { class: 'card scroll', id: 'traj-detail' }, el('p', { class: 'muted' }, 'Select a trajectory.'))),
      el('h2', { id: 'spec' }, 'Submitted spec'),
      el('pre', { class: 'spec', id: 'spec-text' }, this.spec ? JSON.stringify(this.spec, null, 2) : 'not available'),
    );
  }

  series(get) {
    const out = [];
    for (const [step, m] of [...this.steps.entries()].sort((a, b) => a[0] - b[0])) {
      const v = get(m);
      if (typeof v === 'number' && Number.isFinite(v)) out.push([step, v]);
    }
    return out;
  }

  // One faint raw line and its smoothed line per named getter.
  smoothed(named, withRaw = true) {
    const out = [];
    named.forEach(([name, get], i) => {
      const pts = this.series(get);
      const color = COLORS[i % COLORS.length];
      if (withRaw && this.smoothing > 1) out.push({ name: name + ' (raw)', points: pts, color, faint: true });
      out.push({ name, points: smooth(pts, this.smoothing), color });
    });
    return out;
  }

  tasks() {
    const names = new Set();
    for (const m of this.steps.values()) Object.keys(m.tasks || {}).forEach((t) => names.add(t));
    if (this.spec && this.spec.tasks) this.spec.tasks.forEach((t) => names.add(t.domain));
    return [...names].sort();
  }

  render() {
    this.renderHead();
    const tasks = this.tasks();
    // Learning curves: success with the random-policy baseline, reward, evaluation.
    const succ = this.smoothed(tasks.map((t) => [t, (m) => (m.tasks && m.tasks[t] && m.tasks[t].trajectories ? m.tasks[t].success_rate : undefined)]));
    tasks.forEach((t, i) => {
      const b = this.baselines[t];
      if (typeof b === 'number' && this.steps.size) {
        const xs = [...this.steps.keys()];
        succ.push({ name: `${t}: random policy ${fmt(b)}`, points: [[Math.min(...xs), b], [Math.max(...xs), b]], color: COLORS[i % COLORS.length], dash: true });
      }
    });
    const evalSeries = [];
    const evalTasks = new Set();
    for (const m of this.steps.values()) for (const e of m.eval || []) Object.keys(e.tasks || {}).forEach((t) => evalTasks.add(t));
    [...evalTasks].sort().forEach((t, i) => {
      const pts = [], err = {};
      for (const m of this.steps.values()) for (const e of m.eval || []) {
        const r = e.tasks && e.tasks[t];
        if (r) { pts.push([e.step, r.pass_at_1]); err[e.step] = r.pass_at_1_stderr; }
      }
      pts.sort((a, b) => a[0] - b[0]);
      evalSeries.push({ name: `${t} pass@1`, points: pts, err, color: COLORS[i % COLORS.length], marks: true });
    });
    $('#curve-grid').replaceChildren(
      lineChart('Success rate per task', succ, { ymin: 0, ymax: 1, integerX: true }),
      lineChart('Mean reward per task', this.smoothed(tasks.map((t) => [t, (m) => (m.tasks && m.tasks[t] && m.tasks[t].trajectories ? m.tasks[t].mean_reward : undefined)])), { integerX: true }),
      lineChart('Held-out evaluation (pass@1 ± s.e.)', evalSeries, { ymin: 0, ymax: 1, empty: 'no evaluation configured ([eval])' }),
      lineChart('Truncation rate per task', tasks.map((t, i) => ({ name: t, points: this.series((m) => (m.tasks && m.tasks[t] && m.tasks[t].trajectories ? m.tasks[t].truncation_rate : undefined)), color: COLORS[i % COLORS.length] })), { ymin: 0, integerX: true }),
    );
    const tr = (k) => (m) => (m.trainer ? m.trainer[k] : undefined);
    $('#trainer-grid').replaceChildren(
      lineChart('Loss', this.smoothed([['loss', (m) => m.loss], ['policy loss', tr('policy_loss')]]), { integerX: true }),
      lineChart('KL to the reference', this.smoothed([['kl', tr('kl')]]), { integerX: true }),
      lineChart('Entropy', this.smoothed([['entropy', tr('entropy')]]), { integerX: true }),
      lineChart('Gradient norm', this.smoothed([['grad norm', tr('grad_norm')]]), { integerX: true }),
      lineChart('Learning rate', [{ name: 'lr', points: this.series(tr('lr')), color: COLORS[0] }], { integerX: true }),
      lineChart('Clip fractions', [{ name: 'low', points: this.series(tr('clip_frac_low')), color: COLORS[0] }, { name: 'high', points: this.series(tr('clip_frac_high')), color: COLORS[1] }], { ymin: 0, integerX: true }),
      lineChart('Importance weights', [{ name: 'mean', points: this.series(tr('is_weight_mean')), color: COLORS[0] }, { name: 'max', points: this.series(tr('is_weight_max')), color: COLORS[1] }], { integerX: true }),
      lineChart('Response length (tokens)', [{ name: 'mean', points: this.series(tr('response_len_mean')), color: COLORS[0] }, { name: 'max', points: this.series(tr('response_len_max')), color: COLORS[1] }], { ymin: 0, integerX: true }),
    );
    const pools = new Set();
    for (const m of this.steps.values()) Object.keys(m.pools || {}).forEach((p) => pools.add(p));
    $('#system-grid').replaceChildren(
      lineChart('Throughput (trajectories/s)', this.smoothed([['trajectories/s', (m) => m.trajectories_per_s]]), { ymin: 0, integerX: true }),
      lineChart('Bubble ratio and pool utilisation', [
        { name: 'bubble ratio', points: this.series((m) => m.bubble_ratio), color: COLORS[1] },
        ...[...pools].sort().map((p, i) => ({ name: `${p} utilisation`, points: this.series((m) => (m.pools && m.pools[p] ? m.pools[p].utilisation : undefined)), color: COLORS[(i + 2) % COLORS.length] })),
      ], { ymin: 0, ymax: 1, integerX: true }),
      lineChart('Staleness (policy versions)', [
        { name: 'mean', points: this.series((m) => m.staleness_mean), color: COLORS[0] },
        { name: 'max', points: this.series((m) => m.staleness_max), color: COLORS[1] },
      ], { ymin: 0, integerX: true }),
      lineChart('Step time (s)', [
        { name: 'step', points: this.series((m) => m.step_s), color: COLORS[0] },
        { name: 'training', points: this.series((m) => m.train_s), color: COLORS[2] },
        { name: 'wait for batch', points: this.series((m) => m.wait_batch_s), color: COLORS[3] },
        { name: 'weight sync', points: this.series((m) => (m.rollout ? m.rollout.weight_sync_s : undefined)), color: COLORS[4] },
      ], { ymin: 0, integerX: true }),
    );
    this.renderTimeline();
  }

  renderHead() {
    const j = this.job, m = j.metrics || {};
    const terminal = TERMINAL.includes(j.state);
    if (terminal) j.cancelling = false;
    const cancel = el('button', {
      id: 'cancel', class: 'danger', disabled: terminal || j.cancelling,
      onclick: () => this.cancel(),
    }, j.cancelling ? 'cancelling…' : this.confirmCancel ? 'click again to cancel' : 'Cancel job');
    $('#head').replaceChildren(...[
      el('div', { class: 'jobhead' },
        el('h1', {}, j.name ? `${j.name} ` : '', el('span', { class: 'muted' }, j.id)),
        stateBadge(j.state), progressBar(j.step, j.steps),
        el('span', { id: 'step-count' }, `step ${j.step} / ${j.steps}`),
        cancel),
      j.error ? el('p', { class: 'error' }, j.error) : null,
      el('div', { class: 'kv' },
        [['success', m.success_rate], ['mean reward', m.mean_reward], ['policy version', m.version],
          ['trajectories/s', m.trajectories_per_s], ['bubble ratio', m.bubble_ratio], ['staleness mean', m.staleness_mean],
          ['elapsed', m.elapsed_s === undefined ? undefined : duration(m.elapsed_s)], ['step time', m.step_s === undefined ? undefined : duration(m.step_s)]]
          .map(([k, v]) => el('div', {}, el('b', {}, typeof v === 'string' ? v : fmt(v)), el('span', {}, k)))),
    ].filter(Boolean));
  }

  async cancel() {
    if (!this.confirmCancel) {
      this.confirmCancel = true;
      this.renderHead();
      this.timers.push(setTimeout(() => { this.confirmCancel = false; this.renderHead(); }, 5000));
      return;
    }
    this.job.cancelling = true;
    this.renderHead();
    try {
      const r = await (await api(this.base + '/cancel', { method: 'POST' })).json();
      this.job.state = r.state;
      if (r.cancel && r.cancel.message) banner(r.cancel.message);
    } catch (e) {
      banner('cancel failed: ' + e.message);
      this.job.cancelling = false;
    }
    this.renderHead();
  }

  // Rows: a pool's shards, a task's environments, a deployment's instances (each averaged),
  // or their members when expanded. Columns: steps.
  renderTimeline() {
    const box = $('#timeline');
    const steps = [...this.timeline.keys()].sort((a, b) => a - b);
    if (!steps.length) {
      box.replaceChildren(el('p', { class: 'muted' }, 'No per-resource timeline (recorded for jobs on real hardware, after their first step).'));
      return;
    }
    const groups = new Map(); // group label -> Set(resource)
    for (const s of steps) for (const r of Object.keys(this.timeline.get(s))) {
      const m = r.match(/^(shard|env|fn) ([^/]+)\//);
      const g = m ? `${m[1] === 'shard' ? 'pool' : m[1]} ${m[2]}` : r;
      if (!groups.has(g)) groups.set(g, new Set());
      groups.get(g).add(r);
    }
    const rows = [];
    for (const g of [...groups.keys()].sort(kindOrder)) {
      const members = [...groups.get(g)].sort(natural);
      rows.push({ label: `${g} (${members.length})`, group: g, members, open: this.expanded.has(g) });
      if (this.expanded.has(g)) for (const r of members.slice(0, 64)) rows.push({ label: '   ' + r, members: [r], child: true });
    }
    // At most 300 columns: wider runs are binned.
    const bin = Math.max(1, Math.ceil(steps.length / 300));
    const cols = [];
    for (let i = 0; i < steps.length; i += bin) cols.push(steps.slice(i, i + bin));
    const L = 200, cw = Math.max(2, Math.min(36, Math.floor(1100 / cols.length))), rh = 16;
    const W = L + cols.length * cw + 10, H = rows.length * rh + 22;
    const s = svg('svg', { viewBox: `0 0 ${W} ${H}`, style: `max-width:${W}px` });
    rows.forEach((row, ri) => {
      const y = ri * rh;
      const g = svg('g', { class: 'row', 'data-row': row.group || row.members[0] });
      g.append(svg('text', { x: 4, y: y + 12, style: row.child ? '' : 'font-weight:600;fill:#374151' }, (row.group ? (row.open ? '▾ ' : '▸ ') : '') + row.label.trim()));
      cols.forEach((c, ci) => {
        let sum = 0, n = 0;
        for (const st of c) {
          const t = this.timeline.get(st);
          for (const r of row.members) if (r in t) { sum += t[r]; n++; }
        }
        const v = n ? sum / n : 0;
        g.append(svg('rect', { x: L + ci * cw, y: y + 1, width: cw - 0.5, height: rh - 2, fill: heat(v) },));
        g.lastChild.append(svg('title', {}, `${row.label.trim()} · step ${c[0]}${c.length > 1 ? '–' + c[c.length - 1] : ''}: ${(100 * v).toFixed(0)} % busy`));
      });
      if (row.group) g.addEventListener('click', () => {
        if (this.expanded.has(row.group)) this.expanded.delete(row.group); else this.expanded.add(row.group);
        this.renderTimeline();
      });
      s.append(g);
    });
    const y = rows.length * rh + 14;
    for (const t of niceTicks(steps[0], steps[steps.length - 1], 8)) {
      const ci = cols.findIndex((c) => c[c.length - 1] >= t);
      if (ci >= 0 && Number.isInteger(t)) s.append(svg('text', { x: L + ci * cw + cw / 2, y, 'text-anchor': 'middle' }, t));
    }
    s.append(svg('text', { x: L - 6, y, 'text-anchor': 'end' }, 'step'));
    box.replaceChildren(s);
  }

  async pollFunctions() {
    const box = $('#fn');
    try {
      const c = await getJson('/v1/cluster');
      const fns = c.functions || [];
      if (!fns.length) {
        box.replaceChildren(el('p', { class: 'muted' }, 'No function deployments are visible (the local runtime has none, or this token is not an admin).'));
      } else {
        const head = ['deployment', 'desired', 'starting', 'ready', 'draining', 'autoscaler', 'requests', 'peak', 'scale ↑/↓', 'crashed', 'calls', 'retries', 'hedges', 'failures', 'ejections'];
        box.replaceChildren(el('p', { class: 'muted' }, 'The local function runtime is shared by every job of this service.'), el('table', { id: 'fn-table' },
          el('thead', {}, el('tr', {}, head.map((h, i) => el('th', { class: i ? 'num' : '' }, h)))),
          el('tbody', {}, fns.map((f) => {
            const r = f.router || {};
            return el('tr', {},
              el('td', {}, f.name),
              ...[f.desired, f.starting, f.ready, f.draining].map((v) => el('td', { class: 'num' }, fmt(v))),
              el('td', { class: 'num' }, f.panicking ? 'panic' : 'stable'),
              ...[f.requests, f.peak_requests].map((v) => el('td', { class: 'num' }, fmt(v))),
              el('td', { class: 'num' }, `${f.scale_ups} / ${f.scale_downs}`),
              ...[f.instances_crashed + (f.instances_died_serving || 0), r.calls, r.retries, r.hedges, r.failures, r.ejections].map((v) => el('td', { class: 'num' }, fmt(v))));
          }))));
      }
    } catch (e) {
      if (!(e instanceof Unauthorized)) box.replaceChildren(el('p', { class: 'error' }, e.message));
    }
    if (!TERMINAL.includes(this.job.state)) this.timers.push(setTimeout(() => this.pollFunctions(), 3000));
  }

  // A page of trajectories (decoded text where the job has a tokenizer): the newest 50, the
  // oldest 50, or the 50 after the page shown.
  async loadTrajectories(which) {
    const first = which !== 'next';
    const after = first ? 0 : this.traj.next;
    const q = (text) => `${this.base}/trajectories?after=${after}&limit=50${which === 'newest' ? '&newest=true' : ''}${text ? '&text=true' : ''}`;
    let r;
    try {
      r = await api(q(this.traj.text));
    } catch (e) {
      if (e.status !== 400 || !this.traj.text) throw e;
      this.traj.text = false; // simulated pools: token ids only
      r = await api(q(false));
    }
    const rows = (await r.text()).split('\n').filter((l) => l.trim()).map((l) => JSON.parse(l));
    if (!rows.length && !first) {
      $('#traj-info').textContent = 'no newer trajectories yet';
      return;
    }
    this.traj.rows = rows;
    this.traj.next = +(r.headers.get('x-next-cursor') || after);
    $('#traj-info').textContent = rows.length ? `cursor ${rows[0].cursor}–${rows[rows.length - 1].cursor}` : 'none yet';
    const list = el('table', { id: 'traj-table' },
      el('thead', {}, el('tr', {}, ['trajectory', 'task', 'reward', 'outcome', 'versions', 'turns', 'seconds', 'trained'].map((h) => el('th', {}, h)))),
      el('tbody', {}, rows.map((row, i) => {
        const t = row.trajectory;
        const vs = t.turns.flatMap((u) => (u.versions || []).map((v) => v.version));
        const outcome = t.failure ? failure(t.failure) : t.truncated ? 'truncated' : t.success ? 'success' : 'no success';
        return el('tr', { class: 'click', 'data-traj': t.id, onclick: (e) => { this.showTrajectory(i); e.currentTarget.parentNode.querySelectorAll('tr').forEach((x) => x.classList.remove('sel')); e.currentTarget.classList.add('sel'); } },
          el('td', {}, t.id), el('td', {}, t.task), el('td', { class: 'num' }, fmt(t.reward)),
          el('td', {}, outcome),
          el('td', {}, vs.length ? `v${t.start_version} → v${Math.max(...vs)}` : `v${t.start_version}`),
          el('td', { class: 'num' }, t.turns.length),
          el('td', { class: 'num' }, fmt(t.timings.ended_at_s - t.timings.started_at_s, 2)),
          el('td', {}, row.trained_step ? `step ${row.trained_step}` : '–'));
      })));
    $('#traj-list').replaceChildren(rows.length ? list : el('p', { class: 'muted' }, 'No trajectories stored yet.'));
  }

  showTrajectory(i) {
    const row = this.traj.rows[i];
    const t = row.trajectory;
    const tm = t.timings;
    const parts = [
      el('h3', {}, t.id, ' ', el('span', { class: 'muted' }, `${t.task} · seed ${t.seed} · pool ${t.pool}/${t.shard}`)),
      el('div', { class: 'kv' },
        [['reward', fmt(t.reward)], ['success', t.success ? 'yes' : 'no'], ['started on', 'v' + t.start_version],
          ['reset', duration(tm.reset_s)], ['generate', duration(tm.generate_s)], ['env step', duration(tm.env_step_s)],
          ['reward fn', duration(tm.reward_s)], ['waiting', duration(tm.wait_s)]]
          .map(([k, v]) => el('div', {}, el('b', {}, v), el('span', {}, k)))),
      t.failure ? el('p', { class: 'error' }, 'failure: ' + failure(t.failure)) : null,
      t.truncated ? el('p', { class: 'muted' }, 'ended at its context budget (truncated)') : null,
      t.agent ? agentSummary(t.agent) : null,
    ];
    // Agent episodes: each diverged history (edited, summarised) starts a segment.
    const restarts = t.turns.filter((u) => u.restart).length;
    if (restarts > 0) {
      parts.push(el('p', { class: 'muted', 'data-segments': restarts + 1 },
        `${restarts + 1} segments: the agent's history diverged from the context ${restarts} time${restarts > 1 ? 's' : ''}; each segment trains under its own context`));
    }
    t.turns.forEach((u, k) => {
      const text = row.text ? row.text[k] : null;
      const vers = (u.versions || []).map((v) => `v${v.version}×${v.tokens}`).join(' ');
      const c = u.call;
      const call = c ? ` · ${c.api}${c.stream ? ' (streamed)' : ''} → ${c.finish_reason} in ${duration(c.latency_s)}` : '';
      const calls = c && c.tool_calls && c.tool_calls.length
        ? el('pre', { class: 'calls' }, c.tool_calls.map((x) => `→ ${x.name}(${JSON.stringify(x.arguments)}) [${x.id}]`).join('\n'))
        : null;
      const results = c && c.tool_results && c.tool_results.length
        ? el('pre', { class: 'calls' }, c.tool_results.map((x) => `← [${x.tool_call_id}] ${x.content}`).join('\n'))
        : null;
      parts.push(el('div', { class: 'turn', 'data-turn': k },
        el('div', { class: 'meta' }, `turn ${k + 1} · env reward ${fmt(u.env_reward)} · ${u.response_tokens.length} tokens · ${vers}${u.dropped ? ` · ${u.dropped} earlier turns dropped` : ''}${u.restart ? ' · new segment (history diverged)' : ''}${call}`),
        results,
        el('pre', { class: 'obs' }, text ? text.observation : `[${u.observation_tokens.join(' ')}]`),
        el('pre', { class: 'resp' }, text ? text.response : `[${u.response_tokens.join(' ')}]`),
        calls,
        c && c.invalid_tool_call ? el('p', { class: 'error' }, 'invalid tool call: ' + c.invalid_tool_call) : null));
    });
    $('#traj-detail').replaceChildren(...parts.filter(Boolean));
  }
}

// An agent episode's end: its answer, how the program ended, a policy failure, its info.
function agentSummary(a) {
  return el('div', { class: 'agent', 'data-agent': a.ended },
    el('div', { class: 'kv' },
      [['answer', a.answer || '—'], ['ended', a.ended || '—'], ['wall time', duration(a.wall_s)],
        ['refused calls', String(a.refused_calls || 0)]]
        .map(([k, v]) => el('div', {}, el('b', {}, v), el('span', {}, k)))),
    a.policy_failure ? el('p', { class: 'error' }, 'policy failure: ' + a.policy_failure) : null,
    a.info ? el('pre', { class: 'calls' }, 'info: ' + JSON.stringify(a.info)) : null);
}

function failure(f) {
  if (typeof f === 'string') return f;
  if (f && f.kind) return f.detail ? `${f.kind}: ${f.detail}` : f.kind;
  const [k, v] = Object.entries(f)[0] || ['failed', ''];
  return v ? `${k}: ${v}` : k;
}
function heat(v) {
  // white → blue by busy fraction
  const t = Math.max(0, Math.min(1, v));
  const r = Math.round(241 - t * (241 - 30)), g = Math.round(245 - t * (245 - 64)), b = Math.round(249 - t * (249 - 175));
  return `rgb(${r},${g},${b})`;
}
function kindOrder(a, b) {
  const k = (s) => ['pool', 'env', 'fn'].indexOf(s.split(' ')[0]);
  return k(a) - k(b) || natural(a, b);
}
function natural(a, b) { return a.localeCompare(b, undefined, { numeric: true }); }

$('#token-form').addEventListener('submit', (e) => {
  e.preventDefault();
  token = $('#token').value.trim();
  localStorage.setItem('rollarc.token', token);
  route();
});
$('#token').value = token;
window.addEventListener('hashchange', route);
route();
