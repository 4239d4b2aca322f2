// rollarc's dashboard: a single page over the job API (no framework, no build step). Charts
// are hand-drawn SVG. Live updates come from the job's event stream, read with fetch so the
// access token travels in the Authorization header, resumed with Last-Event-ID. Pages: the
// job list (#/), a job (#/jobs/ID), runs compared side by side (#/compare/ID,ID,...).
'use strict';

const TERMINAL = ['succeeded', 'failed', 'cancelled'];
const PAGE = 50; // trajectories per page
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
  if (a < 0.01) return v.toPrecision(3); // 0.00410, not 0.004
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
  for (const [k, v] of Object.entries(attrs)) if (v !== undefined && v !== null) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

// The spacing of about `n` ticks over [lo, hi]: 1, 2, 2.5 or 5 times a power of ten, at least
// `minStep` (1 on an axis of steps, which has no fractional ticks).
function tickStep(lo, hi, n, minStep = 0) {
  const raw = (hi - lo) / n;
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw * (1 - 1e-9)) || raw;
  return Math.max(step, minStep);
}
function ticksBy(lo, hi, step) {
  const out = [];
  for (let i = Math.ceil(lo / step - 1e-9); i * step <= hi + step * 1e-9; i++) out.push(+(i * step).toPrecision(12));
  return out;
}
function niceTicks(lo, hi, n = 5, minStep = 0) {
  if (!(hi > lo)) hi = lo + 1;
  return ticksBy(lo, hi, tickStep(lo, hi, n, minStep));
}
// The decimals that write every multiple of `step` exactly (0.25 → 2, 2e-5 → 5, 50 → 0).
function decimals(step) {
  for (let d = 0; d < 15; d++) {
    const x = step * Math.pow(10, d);
    if (Math.abs(x - Math.round(x)) < 1e-6 * x) return d;
  }
  return 15;
}
// Tick labels with the digits their spacing needs, so that neighbours never read the same:
// 0.25 apart → "0.25", "0.50"; 2.5e-5 apart → "0.004925"; tiny or huge values in exponent
// form ("2.5e-4", "1.2e6").
function tickLabels(ticks, step) {
  const big = Math.max(...ticks.map(Math.abs));
  const d = decimals(step);
  if (big >= 1e6 || (big > 0 && big < 1e-3) || d > 8) {
    const m = Math.min(12, decimals(step / Math.pow(10, Math.floor(Math.log10(big)))));
    return ticks.map((t) => (t === 0 ? '0' : t.toExponential(m).replace('e+', 'e')));
  }
  return ticks.map((t) => (t === 0 ? '0' : t.toFixed(d)));
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

// A line chart. series: [{name, points: [[x, y]], color, dash, faint, marks, err, job}].
// The y range covers every series, the faint raw ones included, and is widened outward to
// whole ticks, so that no extreme (a gradient-norm spike) touches the frame or lies beyond
// the last labelled tick. A series of one point is a dot. opts: ymin/ymax (always inside
// the range), integerX (an axis of steps: integer ticks only), empty (the no-data text).
function lineChart(title, series, opts = {}) {
  const box = el('div', { class: 'card chart', 'data-chart': title });
  box.append(el('h3', {}, title));
  const all = series.flatMap((s) => s.points.map((p) => [p[0], p[1], s.err ? s.err[p[0]] || 0 : 0]));
  if (!all.length) {
    box.append(el('div', { class: 'empty' }, opts.empty || 'no data yet'));
    return box;
  }
  const W = 520, H = 210, R = 12, T = 8, B = 24;
  let xlo = Math.min(...all.map((p) => p[0])), xhi = Math.max(...all.map((p) => p[0]));
  if (opts.xmin !== undefined) xlo = Math.min(xlo, opts.xmin);
  if (xhi === xlo) { xlo -= 0.5; xhi += 0.5; }
  let ylo = Math.min(...all.map((p) => p[1] - p[2])), yhi = Math.max(...all.map((p) => p[1] + p[2]));
  if (opts.ymin !== undefined) ylo = Math.min(ylo, opts.ymin);
  if (opts.ymax !== undefined) yhi = Math.max(yhi, opts.ymax);
  if (yhi === ylo) {
    const d = Math.abs(yhi) * 0.1 || 1;
    if (opts.ymin === undefined || ylo > opts.ymin) ylo -= d;
    yhi += d;
  }
  const ystep = tickStep(ylo, yhi, 4);
  ylo = Math.floor(ylo / ystep + 1e-9) * ystep;
  yhi = Math.ceil(yhi / ystep - 1e-9) * ystep;
  const yticks = ticksBy(ylo, yhi, ystep), ylabels = tickLabels(yticks, ystep);
  const xstep = tickStep(xlo, xhi, 6, opts.integerX ? 1 : 0);
  const xticks = ticksBy(xlo, xhi, xstep), xlabels = tickLabels(xticks, xstep);
  const L = Math.max(36, 12 + 6.3 * Math.max(...ylabels.map((l) => l.length)));
  const X = (x) => L + (W - L - R) * (x - xlo) / (xhi - xlo);
  const Y = (y) => T + (H - T - B) * (1 - (y - ylo) / (yhi - ylo));
  const s = svg('svg', { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: 'none', role: 'img', 'data-ylo': ylo, 'data-yhi': yhi });
  yticks.forEach((t, i) => {
    s.append(svg('line', { class: 'gridline', x1: L, x2: W - R, y1: Y(t), y2: Y(t) }));
    s.append(svg('text', { class: 'ytick', x: L - 4, y: Y(t) + 4, 'text-anchor': 'end' }, ylabels[i]));
  });
  xticks.forEach((t, i) => s.append(svg('text', { class: 'xtick', x: X(t), y: H - 6, 'text-anchor': 'middle' }, xlabels[i])));
  s.append(svg('line', { class: 'axis', x1: L, x2: L, y1: T, y2: H - B }));
  s.append(svg('line', { class: 'axis', x1: L, x2: W - R, y1: H - B, y2: H - B }));
  for (const se of series) {
    if (!se.points.length) continue;
    const g = svg('g', { 'data-series': se.name, 'data-points': se.points.length, 'data-job': se.job });
    if (se.marks || se.points.length === 1) {
      for (const [x, y] of se.points) {
        const e = se.err ? se.err[x] || 0 : 0;
        if (e > 0) g.append(svg('line', { x1: X(x), x2: X(x), y1: Y(y - e), y2: Y(y + e), stroke: se.color, 'stroke-width': 1.2 }));
        g.append(svg('circle', { cx: X(x), cy: Y(y), r: se.faint ? 2 : 3, fill: se.color, 'fill-opacity': se.faint ? 0.45 : 1 }));
      }
    }
    if (se.points.length > 1) {
      const attrs = {
        fill: 'none', stroke: se.color, 'stroke-width': se.faint ? 1 : 1.8,
        'stroke-opacity': se.faint ? 0.45 : se.marks ? 0.5 : 1, 'vector-effect': 'non-scaling-stroke',
        d: 'M' + se.points.map((p) => X(p[0]).toFixed(1) + ',' + Y(p[1]).toFixed(1)).join('L'),
      };
      if (se.dash) attrs['stroke-dasharray'] = '5 4';
      g.append(svg('path', attrs));
    }
    s.append(g);
  }
  box.append(s);
  const legend = el('div', { class: 'legend' });
  for (const se of series) {
    if (se.faint || se.hideLegend) continue;
    const sw = el('i');
    sw.style.background = se.color;
    if (se.dash) sw.style.background = `repeating-linear-gradient(90deg, ${se.color} 0 5px, transparent 5px 9px)`;
    const last = se.points.length ? se.points[se.points.length - 1][1] : null;
    legend.append(el('span', { 'data-job': se.job }, sw, se.name + (last !== null && !se.dash ? ' ' + fmt(last) : '')));
  }
  box.append(legend);
  return box;
}

// A series per getter over step records (a Map step -> metrics), in step order.
function seriesOf(steps, get) {
  const out = [];
  for (const [step, m] of [...steps.entries()].sort((a, b) => a[0] - b[0])) {
    const v = get(m);
    if (typeof v === 'number' && Number.isFinite(v)) out.push([step, v]);
  }
  return out;
}

// Every step record of a job after `after`, page by page, each passed to `each`; returns the
// first page's event id (where an event stream resumes).
async function loadAllSteps(base, after, each) {
  let eventId = null;
  for (;;) {
    const p = await getJson(`${base}/steps?after=${after}&limit=1000`);
    if (eventId === null) eventId = p.event_id;
    p.steps.forEach(each);
    if (p.steps.length < 1000) return eventId;
    after = p.steps[p.steps.length - 1].step;
  }
}

function smoothingSelect(id, value, onchange) {
  return el('select', { id, onchange: (e) => onchange(+e.target.value) },
    [1, 5, 10, 25].map((w) => el('option', { value: w, selected: w === value }, w === 1 ? 'none' : `trailing ${w}-step mean`)));
}

// ---- routing ----------------------------------------------------------------------------

function route() {
  if (page) page.close();
  page = null;
  banner('');
  const m = location.hash.match(/^#\/jobs\/([^/]+)/);
  const c = location.hash.match(/^#\/compare\/([^/]+)/);
  page = m ? new JobPage(decodeURIComponent(m[1]))
    : c ? new ComparePage(c[1].split(',').map(decodeURIComponent).filter(Boolean))
      : new JobList();
  page.open().catch(showError);
}

function showError(e) {
  if (e instanceof Unauthorized) return;
  $('#main').replaceChildren(el('p', { class: 'error' }, String(e.message || e)));
}

function tagChips(tags, onclick) {
  return (tags || []).map((t) => el('span', {
    class: 'tag', 'data-tag': t, title: onclick ? `only the jobs tagged ${t}` : undefined,
    onclick: onclick ? (e) => { e.stopPropagation(); onclick(t); } : undefined,
  }, t));
}

// ---- job list ---------------------------------------------------------------------------

class JobList {
  constructor() {
    this.timer = null;
    this.selected = new Set(); // ids ticked for comparison
    this.tag = null; // only the jobs with this tag
  }
  close() { clearTimeout(this.timer); }
  async open() {
    $('#crumbs').replaceChildren('jobs');
    await this.refresh();
  }
  filterTag(t) {
    this.tag = t;
    this.refresh();
  }
  async refresh() {
    clearTimeout(this.timer);
    let jobs;
    try {
      jobs = (await getJson('/v1/jobs' + (this.tag ? '?tag=' + encodeURIComponent(this.tag) : ''))).jobs;
    } catch (e) {
      showError(e);
      return;
    }
    jobs.sort((a, b) => b.created_at_ms - a.created_at_ms);
    const listed = new Set(jobs.map((j) => j.id));
    for (const id of this.selected) if (!listed.has(id)) this.selected.delete(id);
    const rows = jobs.map((j) => {
      const m = j.metrics || {};
      return el('tr', { class: 'click', 'data-job': j.id, onclick: () => { location.hash = '#/jobs/' + encodeURIComponent(j.id); } },
        el('td', { class: 'pick', onclick: (e) => e.stopPropagation() },
          el('input', {
            type: 'checkbox', 'data-pick': j.id, 'aria-label': `compare ${j.id}`, checked: this.selected.has(j.id),
            onchange: (e) => {
              if (e.target.checked) this.selected.add(j.id); else this.selected.delete(j.id);
              this.updateCompare();
            },
          })),
        el('td', {}, el('a', { href: '#/jobs/' + encodeURIComponent(j.id) }, j.id)),
        el('td', {}, j.name || ''),
        el('td', { class: 'tags' }, tagChips(j.tags, (t) => this.filterTag(t))),
        el('td', {}, stateBadge(j.state)),
        el('td', {}, progressBar(j.step, j.steps)),
        el('td', { class: 'num steps' }, `${j.step} / ${j.steps}`),
        el('td', { class: 'num' }, fmt(m.success_rate)),
        el('td', { class: 'num' }, fmt(m.mean_reward)),
        el('td', {}, new Date(j.created_at_ms).toLocaleString()),
        el('td', { class: 'error' }, j.error || ''));
    });
    const table = el('table', { id: 'jobs' },
      el('thead', {}, el('tr', {}, ['', 'job', 'name', 'tags', 'state', 'progress', 'steps', 'success', 'reward', 'submitted', 'error'].map((h) => el('th', {}, h)))),
      el('tbody', {}, rows));
    const controls = el('div', { class: 'controls' },
      el('button', { id: 'compare', onclick: () => this.compare() }, 'Compare'),
      el('span', { class: 'muted', id: 'compare-hint' }),
      this.tag ? el('span', { id: 'tag-filter' }, 'tagged ', tagChips([this.tag]), ' ', el('button', { onclick: () => this.filterTag(null) }, 'show all')) : null);
    $('#main').replaceChildren(el('h1', {}, 'Jobs'), controls,
      jobs.length ? table : el('p', { class: 'muted' }, this.tag ? `No job is tagged ${this.tag}.` : 'No jobs yet: submit one with `rollarc submit FILE` or POST /v1/jobs.'));
    this.updateCompare();
    // Keep polling while anything may still change.
    if (jobs.some((j) => !TERMINAL.includes(j.state)) || !jobs.length) {
      this.timer = setTimeout(() => this.refresh(), 2000);
    }
  }
  updateCompare() {
    const n = this.selected.size;
    $('#compare').disabled = n < 2;
    $('#compare-hint').textContent = n < 2 ? 'tick two or more jobs to compare their curves and specs' : `${n} jobs selected`;
  }
  compare() {
    if (this.selected.size < 2) return;
    location.hash = '#/compare/' + [...this.selected].sort(natural).map(encodeURIComponent).join(',');
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
    // The trajectory list: its page, how it was reached (`mode`: newest or oldest first,
    // `offset`: rows before it), whether the job has text (false on simulated pools).
    this.traj = { rows: [], next: 0, text: true, selected: null, mode: 'newest', offset: 0, seq: 0 };
    this.groups = new Map(); // group id -> {at, p: Promise<{view, rows}>}
    this.showLp = true;
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
    const [spec, submitted, baselines] = await Promise.all([
      getJson(this.base + '/spec').catch(() => null),
      // The text as sent; a 404 `not_recorded` for jobs whose text was not kept.
      api(this.base + '/spec?form=submitted')
        .then(async (r) => ({ text: await r.text(), type: r.headers.get('content-type') || '' }))
        .catch((e) => { if (e instanceof Unauthorized) throw e; return null; }),
      getJson(this.base + '/baselines').catch(() => ({ tasks: {} })),
    ]);
    this.spec = spec;
    this.submitted = submitted;
    this.specForm = submitted ? 'submitted' : 'resolved';
    this.baselines = baselines.tasks || {};
    this.layout();
    this.renderSpec();
    const eventId = await this.loadSteps();
    this.render();
    this.loadTrajectories('newest').catch(showError);
    this.pollFunctions();
    if (!TERMINAL.includes(this.job.state)) this.follow(eventId);
  }

  // The whole history, page by page; the first page's event id is where the stream resumes.
  loadSteps() {
    return loadAllSteps(this.base, 0, (r) => {
      this.steps.set(r.step, r.metrics);
      if (r.metrics.timeline) this.timeline.set(r.step, r.metrics.timeline);
    });
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
    const onFilter = () => this.loadTrajectories('newest');
    const num = (id, label, attrs = {}) => el('label', {}, label,
      el('input', Object.assign({ id, type: 'number', step: 'any', onchange: onFilter }, attrs)));
    main.replaceChildren(
      el('div', { id: 'head' }),
      el('div', { class: 'sections' },
        ['curves', 'trainer', 'system', 'resources', 'functions', 'trajectories', 'spec'].map((s) => el('a', { href: '#', onclick: (e) => { e.preventDefault(); $('#' + s).scrollIntoView(); } }, s))),
      el('h2', { id: 'curves' }, 'Learning curves'),
      el('div', { class: 'controls' }, 'smoothing',
        smoothingSelect('smoothing', this.smoothing, (w) => { this.smoothing = w; this.render(); })),
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
      el('div', { class: 'controls filters', id: 'traj-filters' },
        el('label', {}, 'task', el('select', { id: 'f-task', onchange: onFilter },
          el('option', { value: '' }, 'any'), this.tasks().map((t) => el('option', { value: t }, t)))),
        el('label', {}, 'outcome', el('select', { id: 'f-success', onchange: onFilter },
          [['', 'any'], ['true', 'success'], ['false', 'no success']].map(([v, l]) => el('option', { value: v }, l)))),
        num('f-min-reward', 'reward ≥'), num('f-max-reward', 'reward ≤'),
        num('f-version', 'start version', { min: 0, step: 1 }), num('f-group', 'group', { min: 0, step: 1 }),
        el('button', { id: 'f-clear', onclick: () => { $('#traj-filters').querySelectorAll('input, select').forEach((x) => { x.value = ''; }); onFilter(); } }, 'clear')),
      el('div', { class: 'split' },
        el('div', {},
          el('div', { class: 'controls' },
            el('button', { id: 'traj-newest', onclick: () => this.loadTrajectories('newest') }, 'newest'),
            el('button', { id: 'traj-first', onclick: () => this.loadTrajectories('first') }, 'oldest'),
            el('button', { id: 'traj-next', onclick: () => this.loadTrajectories('next') }, 'next page ›'),
            el('span', { class: 'muted', id: 'traj-info' })),
          el('div', { class: 'scroll card', id: 'traj-list' })),
        el('div', { class: 'card scroll', id: 'traj-detail' }, el('p', { class: 'muted' }, 'Select a trajectory.'))),
      el('div', { class: 'card', id: 'traj-group', hidden: true }),
      el('h2', { id: 'spec' }, 'Submitted spec'),
      el('div', { class: 'controls', id: 'spec-forms' }),
      el('pre', { class: 'spec', id: 'spec-text' }),
    );
  }

  // The spec as sent (TOML or JSON, comments kept) or resolved (every default filled in,
  // without its null values and empty sections).
  renderSpec() {
    const sub = this.submitted, form = sub ? this.specForm : 'resolved';
    const btn = (f, label, disabled) => el('button', {
      id: 'spec-' + f, class: form === f ? 'on' : undefined, disabled,
      onclick: () => { this.specForm = f; this.renderSpec(); },
    }, label);
    $('#spec-forms').replaceChildren(
      btn('submitted', 'as submitted' + (sub ? (/json/.test(sub.type) ? ' (JSON)' : ' (TOML)') : ''), !sub),
      btn('resolved', 'resolved', !this.spec),
      el('span', { class: 'muted' }, sub
        ? (form === 'resolved' ? 'every default filled in; null values and empty sections left out' : 'the text exactly as it was sent')
        : 'the text as sent was not kept for this job: its resolved form, without null values and empty sections'));
    const pre = $('#spec-text');
    pre.dataset.form = form;
    pre.textContent = form === 'submitted' ? sub.text : this.spec ? JSON.stringify(pruned(this.spec), null, 2) : 'not available';
  }

  series(get) { return seriesOf(this.steps, get); }

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
    const pick = $('#f-task');
    if (pick.options.length !== tasks.length + 1) { // tasks seen first in a step record
      const v = pick.value;
      pick.replaceChildren(el('option', { value: '' }, 'any'), tasks.map((t) => el('option', { value: t }, t)));
      pick.value = v;
    }
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
      lineChart('Held-out evaluation (pass@1 ± s.e.)', evalSeries, { ymin: 0, ymax: 1, integerX: true, empty: 'no evaluation configured ([eval])' }),
      lineChart('Truncation rate per task', tasks.map((t, i) => ({ name: t, points: this.series((m) => (m.tasks && m.tasks[t] && m.tasks[t].trajectories ? m.tasks[t].truncation_rate : undefined)), color: COLORS[i % COLORS.length] })), { ymin: 0, integerX: true }),
    );
    const tr = (k) => (m) => (m.trainer ? m.trainer[k] : undefined);
    $('#trainer-grid').replaceChildren(
      lineChart('Loss', this.smoothed([['loss', (m) => m.loss], ['policy loss', tr('policy_loss')]]), { integerX: true }),
      lineChart('KL to the reference', this.smoothed([['kl', tr('kl')]]), { integerX: true }),
      lineChart('Entropy', this.smoothed([['entropy', tr('entropy')]]), { integerX: true }),
      lineChart('Gradient norm', this.smoothed([['grad norm', tr('grad_norm')]]), { integerX: true }),
      // The learning rate is a schedule, never smoothed.
      lineChart('Learning rate', [{ name: 'lr', points: this.series(tr('lr')), color: COLORS[0] }], { integerX: true }),
      lineChart('Clip fractions', [{ name: 'low', points: this.series(tr('clip_frac_low')), color: COLORS[0] }, { name: 'high', points: this.series(tr('clip_frac_high')), color: COLORS[1] }], { ymin: 0, integerX: true }),
      lineChart('Importance weights', [{ name: 'mean', points: this.series(tr('is_weight_mean')), color: COLORS[0] }, { name: 'max', points: this.series(tr('is_weight_max')), color: COLORS[1] }], { integerX: true }),
      lineChart('Response length (tokens)', [{ name: 'mean', points: this.series(tr('response_len_mean')), color: COLORS[0] }, { name: 'max', points: this.series(tr('response_len_max')), color: COLORS[1] }], { ymin: 0, integerX: true }),
    );
    const pools = new Set();
    for (const m of this.steps.values()) Object.keys(m.pools || {}).forEach((p) => pools.add(p));
    // A step's sandbox starts (none: no point, so environments without sandboxes draw nothing).
    const st = (k) => (m) => (m.env_starts && m.env_starts.starts ? m.env_starts[k] : undefined);
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
      lineChart('Sandbox start latency (s)', [
        { name: 'p50', points: this.series(st('p50_s')), color: COLORS[0] },
        { name: 'p99', points: this.series(st('p99_s')), color: COLORS[1] },
      ], { ymin: 0, integerX: true, empty: 'no sandboxed environment' }),
      lineChart('Sandbox warm hit rate', [
        { name: 'warm hits', points: this.series(st('warm_hit_rate')), color: COLORS[2] },
      ], { ymin: 0, ymax: 1, integerX: true, empty: 'no sandboxed environment' }),
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
        el('h1', {}, j.name ? `${j.name} ` : '', el('span', { class: 'muted' }, j.id), ' ', tagChips(j.tags)),
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
    for (const t of niceTicks(steps[0], steps[steps.length - 1], 8, 1)) {
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

  // Trajectory rows for `params` (URLSearchParams), with each turn as text (and, with
  // `pieces`, each response token decoded alone) where the job has a tokenizer; token ids
  // only on simulated pools, whose text query is a 400.
  async fetchRows(params, pieces = false) {
    const url = (text) => {
      const q = new URLSearchParams(params);
      if (text) q.set('text', 'true');
      if (text && pieces) q.set('pieces', 'true');
      return `${this.base}/trajectories?${q}`;
    };
    let r;
    try {
      r = await api(url(this.traj.text));
    } catch (e) {
      if (e.status !== 400 || !this.traj.text) throw e;
      r = await api(url(false)); // a 400 again: the filters were wrong, not the text
      this.traj.text = false;
    }
    const rows = (await r.text()).split('\n').filter((l) => l.trim()).map(parseRow);
    return { rows, next: +(r.headers.get('x-next-cursor') || 0) };
  }

  // The filters as query parameters; null (and a message) when a number does not parse.
  filterParams() {
    const p = new URLSearchParams();
    for (const [id, key] of [['f-task', 'task'], ['f-success', 'success'], ['f-min-reward', 'min_reward'],
      ['f-max-reward', 'max_reward'], ['f-version', 'version'], ['f-group', 'group']]) {
      const input = $('#' + id);
      if (input.validity && input.validity.badInput) {
        $('#traj-info').textContent = `${key.replace('_', ' ')}: not a number`;
        return null;
      }
      if (input.value.trim() !== '') p.set(key, input.value.trim());
    }
    return p;
  }

  // A page of trajectories matching the filters: the newest 50 (shown newest first), the
  // oldest 50, or the 50 after the page shown.
  async loadTrajectories(which) {
    const tr = this.traj;
    const first = which !== 'next';
    const params = this.filterParams();
    if (!params) return;
    const filtered = [...params.keys()].length > 0;
    const after = first ? 0 : tr.next;
    params.set('after', after);
    params.set('limit', PAGE);
    if (which === 'newest') params.set('newest', 'true');
    const seq = ++tr.seq;
    let res;
    try {
      res = await this.fetchRows(params);
    } catch (e) {
      if (e instanceof Unauthorized || seq !== tr.seq) return;
      $('#traj-info').textContent = '';
      $('#traj-list').replaceChildren(el('p', { class: 'error', id: 'traj-error' }, e.message));
      return;
    }
    if (seq !== tr.seq) return; // the filters changed meanwhile: a newer page is on its way
    const rows = res.rows;
    if (!rows.length && !first) {
      $('#traj-info').textContent = 'no newer trajectories yet';
      return;
    }
    if (first) { tr.mode = which; tr.offset = 0; } else tr.offset += tr.rows.length;
    tr.rows = rows;
    tr.next = res.next || after;
    const n = rows.length, matching = filtered ? ' matching' : '';
    $('#traj-info').textContent = !n ? '' : tr.mode === 'newest'
      ? `${first ? `the ${n} newest` : `${n} newer`}${matching} rows, newest first`
      : `rows ${tr.offset + 1}–${tr.offset + n}${matching}, oldest first`;
    const shown = tr.mode === 'newest' ? [...rows].reverse() : rows;
    const list = el('table', { id: 'traj-table' },
      el('thead', {}, el('tr', {}, ['trajectory', 'task', 'reward', 'outcome', 'versions', 'turns', 'seconds', 'trained'].map((h, i) => el('th', { class: [2, 5, 6, 7].includes(i) ? 'num' : undefined }, h)))),
      el('tbody', {}, shown.map((row) => {
        const t = row.trajectory;
        const vs = t.turns.flatMap((u) => (u.versions || []).map((v) => v.version));
        const outcome = t.failure ? failure(t.failure) : t.truncated ? 'truncated' : t.success ? 'success' : 'no success';
        return el('tr', {
          class: 'click', 'data-traj': t.id, 'data-cursor': row.cursor, 'data-task': t.task, 'data-success': String(!!t.success),
          'data-reward': t.reward, 'data-group': t.group_id, 'data-version': t.start_version, onclick: () => this.showTrajectory(row),
        },
        el('td', {}, t.id), el('td', {}, t.task), el('td', { class: 'num' }, fmt(t.reward)),
        el('td', { class: t.failure ? 'error' : undefined }, outcome),
        el('td', {}, vs.length ? `v${t.start_version}→v${Math.max(...vs)}` : `v${t.start_version}`),
        el('td', { class: 'num' }, t.turns.length),
        el('td', { class: 'num' }, fmt(t.timings.ended_at_s - t.timings.started_at_s, 2)),
        el('td', { class: 'num' }, row.trained_step ? `step ${row.trained_step}` : '–'));
      })));
    $('#traj-list').replaceChildren(rows.length ? list
      : filtered ? el('p', { class: 'muted', id: 'traj-empty' }, 'No trajectory matches these filters.')
        : el('p', { class: 'muted' }, 'No trajectories stored yet.'));
    this.markSelected();
  }

  markSelected() {
    const id = this.traj.selected;
    document.querySelectorAll('#traj-table tr[data-traj], #group-table tr[data-group-member]').forEach((r) => {
      r.classList.toggle('sel', (r.dataset.traj || r.dataset.groupMember) === id);
    });
  }

  // A group's members (the group endpoint: rewards, advantages) and their rows with text and
  // per-token pieces; cached a few seconds while the job runs (members get trained).
  groupData(g) {
    const c = this.groups.get(g);
    if (c && (TERMINAL.includes(this.job.state) || Date.now() - c.at < 5000)) return c.p;
    const p = Promise.all([
      getJson(`${this.base}/groups/${g}`),
      this.fetchRows(new URLSearchParams({ group: g, limit: 1000 }), true),
    ]).then(([view, res]) => ({ view, rows: res.rows }));
    this.groups.set(g, { at: Date.now(), p });
    p.catch(() => this.groups.delete(g));
    return p;
  }

  showTrajectory(row) {
    const t = row.trajectory;
    const tm = t.timings;
    this.traj.selected = t.id;
    this.markSelected();
    const kv = (k, v, attrs = {}) => el('div', attrs, el('b', {}, v), el('span', {}, k));
    const parts = [
      el('h3', {}, t.id, ' ', el('span', { class: 'muted' }, `${t.task} · seed ${t.seed} · pool ${t.pool}/${t.shard}`)),
      el('div', { class: 'kv' },
        kv('reward', fmt(t.reward)), kv('advantage', '…', { id: 'traj-adv' }), kv('success', t.success ? 'yes' : 'no'),
        kv('started on', 'v' + t.start_version), kv('trained', row.trained_step ? `step ${row.trained_step}` : '–'),
        kv('seconds', fmt(tm.ended_at_s - tm.started_at_s, 2))),
      el('p', { class: 'muted timings' }, [['generate', tm.generate_s], ['env step', tm.env_step_s], ['reward fn', tm.reward_s],
        ['reset', tm.reset_s], ['waiting', tm.wait_s]].map(([k, v]) => `${k} ${duration(v)}`).join(' · ')),
      verdictBlock(t),
      t.failure ? el('p', { class: 'error' }, 'failure: ' + failure(t.failure)) : null,
      t.truncated ? el('p', { class: 'muted' }, 'ended at its context budget (truncated)') : null,
      t.agent ? agentSummary(t.agent) : null,
      el('div', { class: 'controls' },
        el('button', { id: 'group-view', 'data-group': t.group_id, onclick: () => this.showGroup(t.group_id) }, `group ${t.group_id}: why do its members differ? ›`),
        el('label', { class: 'muted' }, el('input', {
          type: 'checkbox', id: 'lp-show', checked: this.showLp,
          onchange: (e) => { this.showLp = e.target.checked; $('#traj-detail').classList.toggle('nolp', !this.showLp); },
        }), ' per-token log-probs'),
        lpLegend()),
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
        el('div', { class: 'logprobs', 'data-turn': k }, el('span', { class: 'muted' }, 'log-probabilities: loading…')),
        calls,
        c && c.invalid_tool_call ? el('p', { class: 'error' }, 'invalid tool call: ' + c.invalid_tool_call) : null));
    });
    const detail = $('#traj-detail');
    detail.replaceChildren(...parts.filter(Boolean));
    detail.classList.toggle('nolp', !this.showLp);
    const heatmaps = (r) => t.turns.forEach((u, k) => {
      const box = detail.querySelector(`.logprobs[data-turn="${k}"]`);
      const text = r && r.text ? r.text[k] : null;
      if (box) box.replaceChildren(...tokenSpans(u, text ? text.response_pieces : null));
    });
    if (row.text && row.text.every((x) => x.response_pieces) || !this.traj.text) heatmaps(row);
    this.groupData(t.group_id).then(({ view, rows }) => {
      if (this.traj.selected !== t.id) return;
      const m = view.members.find((x) => x.cursor === row.cursor) || view.members.find((x) => x.trajectory_id === t.id);
      const adv = $('#traj-adv');
      if (adv) {
        adv.firstChild.textContent = m ? fmt(m.advantage) : '–';
        if (m && typeof m.advantage === 'number') adv.dataset.advantage = m.advantage;
        adv.title = `estimator ${view.estimator || 'none'}; group reward mean ${fmt(view.reward_mean)}, std ${fmt(view.reward_std)}`;
      }
      $('#group-view').textContent = `group ${t.group_id} (${view.members.length} members): why do they differ? ›`;
      heatmaps(rows.find((r) => r.cursor === row.cursor) || row);
    }).catch((e) => {
      if (e instanceof Unauthorized || this.traj.selected !== t.id) return;
      $('#traj-adv').firstChild.textContent = '–';
      heatmaps(row);
    });
  }

  // "Why do these differ?": the members of a group side by side, with the rewards and the
  // advantages the trainer derives from them. A click on a member shows its turns.
  async showGroup(g) {
    const box = $('#traj-group');
    box.hidden = false;
    box.replaceChildren(el('p', { class: 'muted' }, `loading group ${g}…`));
    let data;
    try {
      data = await this.groupData(g);
    } catch (e) {
      if (!(e instanceof Unauthorized)) box.replaceChildren(el('p', { class: 'error' }, e.message));
      return;
    }
    const { view, rows } = data;
    const byCursor = new Map(rows.map((r) => [r.cursor, r]));
    const ms = view.members;
    const maxAdv = Math.max(1e-12, ...ms.map((m) => Math.abs(m.advantage || 0)));
    const formula = {
      grpo: 'GRPO: advantage = (reward − group mean) / group std',
      dr_grpo: 'Dr. GRPO: advantage = reward − group mean',
      rloo: 'RLOO: advantage = reward − mean of the other members',
    }[view.estimator] || 'no advantage estimator (the trainer computes its own)';
    const masked = ms.filter((m) => m.reward === null).length;
    box.replaceChildren(
      el('div', { class: 'ghead' },
        el('h3', {}, `group ${g} `, el('span', { class: 'muted' }, `${view.task} · ${ms.length} members`)),
        el('button', { id: 'group-close', onclick: () => { box.hidden = true; } }, 'close')),
      el('div', { class: 'kv' }, [['reward mean', fmt(view.reward_mean)], ['reward std', fmt(view.reward_std)],
        ['estimator', view.estimator || 'none'], ['successes', `${ms.filter((m) => m.success).length} / ${ms.length}`],
        ['masked', String(masked)]].map(([k, v]) => el('div', {}, el('b', {}, v), el('span', {}, k)))),
      el('p', { class: 'muted' }, `${formula}${masked ? '; masked members (no reward) get none' : ''}. Click a member for its turns.`),
      el('table', { id: 'group-table', 'data-group': g },
        el('thead', {}, el('tr', {}, ['#', 'trajectory', 'reward', 'advantage', 'outcome', 'tokens', 'trained', 'final answer (as the reward saw it)']
          .map((h, i) => el('th', { class: [0, 2, 3, 5, 6].includes(i) ? 'num' : undefined }, h)))),
        el('tbody', {}, ms.map((m, i) => {
          const bar = el('i', { class: m.advantage < 0 ? 'neg' : 'pos' });
          bar.style.width = (28 * Math.abs(m.advantage || 0) / maxAdv).toFixed(1) + 'px';
          return el('tr', {
            class: 'click', 'data-group-member': m.trajectory_id, 'data-cursor': m.cursor,
            onclick: () => { const r = byCursor.get(m.cursor); if (r) this.showTrajectory(r); },
          },
          el('td', { class: 'num muted' }, i + 1),
          el('td', {}, m.trajectory_id),
          el('td', { class: 'num reward', 'data-reward': m.reward }, fmt(m.reward)),
          el('td', { class: 'num adv', 'data-advantage': m.advantage }, m.advantage === null ? '' : bar, fmt(m.advantage)),
          el('td', { class: m.failure ? 'error' : undefined }, m.failure ? `masked: ${m.failure}` : m.success ? 'success' : 'no success'),
          el('td', { class: 'num' }, m.response_tokens),
          el('td', { class: 'num' }, m.trained_step ? `step ${m.trained_step}` : '–'),
          el('td', { class: 'final', title: m.final_text, onclick: (e) => e.currentTarget.classList.toggle('open') },
            m.final_text === '' ? el('span', { class: 'muted' }, '(empty)') : m.final_text));
        }))));
    this.markSelected();
  }
}

// Drops null values and empty objects (recursively) from a resolved spec.
function pruned(v) {
  if (v === null || v === undefined) return undefined;
  if (Array.isArray(v)) return v.map((x) => (x !== null && typeof x === 'object' ? pruned(x) || {} : x));
  if (typeof v !== 'object') return v;
  const out = {};
  for (const [k, x] of Object.entries(v)) {
    const p = pruned(x);
    if (p !== undefined) out[k] = p;
  }
  return Object.keys(out).length ? out : undefined;
}

// One NDJSON row; seeds (u64) keep every digit (as strings) where the engine has JSON source
// access.
function parseRow(line) {
  return JSON.parse(line, (k, v, ctx) => (k === 'seed' && ctx && typeof ctx.source === 'string' && !Number.isSafeInteger(v) ? ctx.source : v));
}

// The reward's view of a trajectory: the reference, the final text it scored, what the
// environment extracted and each reward function's score and details.
function verdictBlock(t) {
  const v = t.verdict || {};
  const show = (x) => (typeof x === 'string' ? x : JSON.stringify(x));
  const kvs = (o) => (o && typeof o === 'object' && !Array.isArray(o)
    ? Object.entries(o).map(([k, x]) => el('span', { class: 'pair' }, el('span', { class: 'muted' }, k + ' '), el('code', {}, show(x))))
    : el('code', {}, show(o)));
  const line = (key, label, ...value) => el('div', { class: 'vrow', 'data-v': key }, el('span', { class: 'k' }, label), el('span', {}, ...value));
  const fns = v.functions || [];
  return el('div', { class: 'verdict', id: 'traj-verdict' },
    t.reference !== undefined && t.reference !== null ? line('reference', 'reference', kvs(t.reference)) : null,
    t.final_text !== undefined ? line('final', 'final answer', t.final_text === '' ? el('span', { class: 'muted' }, '(empty)') : el('code', {}, t.final_text)) : null,
    v.env && Object.keys(v.env).length ? line('env', 'environment', kvs(v.env)) : null,
    fns.length ? el('table', { class: 'fns' },
      el('thead', {}, el('tr', {}, ['reward function', 'score', 'details'].map((h, i) => el('th', { class: i === 1 ? 'num' : undefined }, h)))),
      el('tbody', {}, fns.map((f) => el('tr', { 'data-fn': f.name },
        el('td', {}, f.name), el('td', { class: 'num' }, fmt(f.score)), el('td', { class: 'details' }, f.details === undefined || f.details === null ? '' : kvs(f.details)))))) : null,
    !fns.length && !v.env && (t.reference === undefined || t.reference === null) ? line('none', 'verdict', el('span', { class: 'muted' }, 'the environment scored it (no reference or reward function recorded)')) : null);
}

// A turn's response tokens, each coloured by the probability the behaviour policy sampled it
// with (its stored log-prob), labelled by its text piece (or id on simulated pools).
function tokenSpans(turn, pieces) {
  const lps = turn.logprobs || [];
  return turn.response_tokens.map((id, i) => {
    const lp = lps[i];
    const piece = pieces ? pieces[i] : null;
    const label = typeof piece === 'string' ? (piece === '' ? `⟨${id}⟩` : piece.replace(/\n/g, '↵\n')) : `${id} `;
    const has = typeof lp === 'number';
    const s = el('span', {
      class: 'tok', 'data-logprob': has ? lp : undefined,
      title: `${typeof piece === 'string' ? JSON.stringify(piece) + ' · ' : ''}token ${id} · ${has ? `logprob ${lp.toFixed(3)} · p ${Math.exp(lp).toFixed(3)}` : 'no logprob'}`,
    }, label);
    s.style.background = has ? lpColor(lp) : '#e5e7eb';
    return s;
  });
}
function lpColor(lp) {
  const p = Math.max(0, Math.min(1, Math.exp(lp)));
  return `hsl(${Math.round(120 * p)}, 72%, ${Math.round(80 + 6 * p)}%)`;
}
function lpLegend() {
  return el('span', { class: 'lp-legend', title: 'The behaviour policy\'s log-probabilities, as sampled (no current-policy log-prob is stored). Hover a token for its value.' },
    'behaviour log-probs (as sampled): p 0', el('i'), '1');
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

// ---- run comparison ---------------------------------------------------------------------

// Two or more runs overlaid, one colour per job, and the paths of their resolved specs that
// differ. Polls while any of them runs.
class ComparePage {
  constructor(ids) {
    this.ids = [...new Set(ids)];
    this.jobs = new Map();
    this.steps = new Map(this.ids.map((id) => [id, new Map()]));
    this.specs = new Map();
    this.smoothing = 5;
    this.task = '';
    this.timers = [];
    this.closed = false;
  }
  close() {
    this.closed = true;
    this.timers.forEach(clearTimeout);
  }
  base(id) { return '/v1/jobs/' + encodeURIComponent(id); }
  label(id) { const j = this.jobs.get(id); return j && j.name ? `${id} ${j.name}` : id; }
  color(id) { return COLORS[this.ids.indexOf(id) % COLORS.length]; }

  async open() {
    $('#crumbs').replaceChildren(el('a', { href: '#/' }, 'jobs'), ' / compare ', this.ids.join(', '));
    if (this.ids.length < 2) {
      $('#main').replaceChildren(el('p', { class: 'muted' }, 'Tick two or more jobs on the job list to compare them.'));
      return;
    }
    const specs = await Promise.all(this.ids.map((id) => getJson(this.base(id) + '/spec').catch(() => null)));
    this.ids.forEach((id, i) => this.specs.set(id, specs[i]));
    await this.load();
    this.layout();
    this.render();
    this.renderDiff();
    this.schedule();
  }

  // Each job's record and its step records after the last one held (without the timeline).
  async load() {
    await Promise.all(this.ids.map(async (id) => {
      this.jobs.set(id, await getJson(this.base(id)));
      const st = this.steps.get(id);
      const after = st.size ? Math.max(...st.keys()) : 0;
      await loadAllSteps(this.base(id), after, (r) => {
        const { timeline, ...m } = r.metrics;
        st.set(r.step, m);
      });
    }));
  }
  schedule() {
    if (this.closed || [...this.jobs.values()].every((j) => TERMINAL.includes(j.state))) return;
    this.timers.push(setTimeout(async () => {
      try {
        await this.load();
      } catch (e) {
        if (!(e instanceof Unauthorized)) banner('refreshing the comparison failed: ' + e.message);
      }
      if (this.closed) return;
      this.render();
      this.schedule();
    }, 3000));
  }

  layout() {
    const tasks = new Set();
    for (const s of this.specs.values()) if (s && s.tasks) s.tasks.forEach((t) => tasks.add(t.domain));
    for (const st of this.steps.values()) for (const m of st.values()) Object.keys(m.tasks || {}).forEach((t) => tasks.add(t));
    $('#main').replaceChildren(
      el('h1', {}, `Compare ${this.ids.length} runs`),
      el('table', { id: 'cmp-jobs' }),
      el('h2', {}, 'Curves'),
      el('div', { class: 'controls' }, 'smoothing',
        smoothingSelect('cmp-smoothing', this.smoothing, (w) => { this.smoothing = w; this.render(); }),
        'task', el('select', { id: 'cmp-task', onchange: (e) => { this.task = e.target.value; this.render(); } },
          el('option', { value: '' }, 'all tasks'), [...tasks].sort().map((t) => el('option', { value: t }, t)))),
      el('div', { class: 'grid', id: 'cmp-grid' }),
      el('h2', {}, 'Spec differences'),
      el('p', { class: 'muted' }, 'Each job\'s resolved spec as dotted paths (rollout.alpha, tasks[0].group_size, …): only the paths whose values differ.'),
      el('div', { class: 'card scroll', id: 'spec-diff-box' }));
  }

  // One line per job (a faint raw line under its trailing mean when `smoothed`).
  overlay(get, smoothed = true) {
    return this.ids.flatMap((id) => {
      const pts = seriesOf(this.steps.get(id), get);
      const base = { color: this.color(id), job: id };
      if (!smoothed || this.smoothing <= 1) return [Object.assign({ name: this.label(id), points: pts }, base)];
      return [Object.assign({ name: this.label(id) + ' (raw)', points: pts, faint: true }, base),
        Object.assign({ name: this.label(id), points: smooth(pts, this.smoothing) }, base)];
    });
  }

  render() {
    const T = this.task;
    const swatch = (id) => { const i = el('i', { class: 'sw' }); i.style.background = this.color(id); return i; };
    $('#cmp-jobs').replaceChildren(
      el('thead', {}, el('tr', {}, ['', 'job', 'name', 'tags', 'state', 'steps', 'success', 'reward'].map((h, i) => el('th', { class: i >= 5 ? 'num' : undefined }, h)))),
      el('tbody', {}, this.ids.map((id) => {
        const j = this.jobs.get(id), m = j.metrics || {};
        return el('tr', { 'data-job': id },
          el('td', {}, swatch(id)), el('td', {}, el('a', { href: '#/jobs/' + encodeURIComponent(id) }, id)),
          el('td', {}, j.name || ''), el('td', {}, tagChips(j.tags)), el('td', {}, stateBadge(j.state)),
          el('td', { class: 'num' }, `${j.step} / ${j.steps}`), el('td', { class: 'num' }, fmt(m.success_rate)), el('td', { class: 'num' }, fmt(m.mean_reward)));
      })));
    const per = (k) => (m) => (T ? (m.tasks && m.tasks[T] && m.tasks[T].trajectories ? m.tasks[T][k] : undefined) : m[k]);
    const tr = (k) => (m) => (m.trainer ? m.trainer[k] : undefined);
    // Held-out pass@1 at each evaluation: the task's, or the mean over the evaluated tasks.
    const evals = this.ids.map((id) => {
      const at = new Map();
      for (const m of this.steps.get(id).values()) for (const e of m.eval || []) {
        const rs = Object.entries(e.tasks || {}).filter(([t]) => !T || t === T).map(([, r]) => r.pass_at_1).filter((x) => typeof x === 'number');
        if (rs.length) at.set(e.step, rs.reduce((a, b) => a + b, 0) / rs.length);
      }
      return { name: this.label(id), job: id, color: this.color(id), marks: true, points: [...at.entries()].sort((a, b) => a[0] - b[0]) };
    });
    const which = T || 'all tasks';
    $('#cmp-grid').replaceChildren(...[
      lineChart(`Success rate (${which})`, this.overlay(per('success_rate')), { ymin: 0, ymax: 1, integerX: true }),
      lineChart(`Mean reward (${which})`, this.overlay(per('mean_reward')), { integerX: true }),
      evals.some((s) => s.points.length) ? lineChart(`Held-out pass@1 (${which})`, evals, { ymin: 0, ymax: 1, integerX: true }) : null,
      lineChart('Loss', this.overlay((m) => m.loss), { integerX: true }),
      lineChart('Step time (s)', this.overlay((m) => m.step_s), { ymin: 0, integerX: true }),
      lineChart('Throughput (trajectories/s)', this.overlay((m) => m.trajectories_per_s), { ymin: 0, integerX: true }),
      lineChart('Entropy', this.overlay(tr('entropy')), { integerX: true }),
      lineChart('Gradient norm', this.overlay(tr('grad_norm')), { integerX: true }),
      lineChart('Learning rate', this.overlay(tr('lr'), false), { integerX: true }),
    ].filter(Boolean));
  }

  renderDiff() {
    const flat = this.ids.map((id) => { const s = this.specs.get(id); return s ? flatten(s) : null; });
    const paths = [], seen = new Set();
    for (const f of flat) if (f) for (const k of Object.keys(f)) if (!seen.has(k)) { seen.add(k); paths.push(k); }
    const known = flat.filter(Boolean);
    const differ = paths.filter((p) => new Set(known.map((f) => (p in f ? f[p] : undefined))).size > 1);
    const missing = this.ids.filter((id, i) => !flat[i]);
    const swatch = (id) => { const i = el('i', { class: 'sw' }); i.style.background = this.color(id); return i; };
    $('#spec-diff-box').replaceChildren(
      el('p', { class: 'muted', id: 'spec-diff-count' }, `${differ.length} of ${paths.length} paths differ` +
        (missing.length ? ` (no spec for ${missing.join(', ')})` : '')),
      differ.length ? el('table', { id: 'spec-diff' },
        el('thead', {}, el('tr', {}, el('th', {}, 'path'), this.ids.map((id) => el('th', { 'data-job': id }, swatch(id), ' ', this.label(id))))),
        el('tbody', {}, differ.map((p) => el('tr', { 'data-path': p }, el('td', { class: 'path' }, p),
          flat.map((f, i) => {
            const v = f ? f[p] : undefined;
            return el('td', { 'data-job': this.ids[i], class: v === undefined ? 'absent' : undefined }, v === undefined ? '—' : v);
          })))))
        : el('p', {}, 'The resolved specs are identical.'));
  }
}

// A spec as {dotted path: JSON value}: objects by key, arrays of objects by index, arrays of
// plain values (tags, seeds) as one value.
function flatten(v, path = '', out = {}) {
  if (v && typeof v === 'object' && !Array.isArray(v) && Object.keys(v).length) {
    for (const [k, x] of Object.entries(v)) flatten(x, path ? `${path}.${k}` : k, out);
  } else if (Array.isArray(v) && v.some((x) => x && typeof x === 'object')) {
    v.forEach((x, i) => flatten(x, `${path}[${i}]`, out));
  } else {
    out[path] = JSON.stringify(v);
  }
  return out;
}

$('#token-form').addEventListener('submit', (e) => {
  e.preventDefault();
  token = $('#token').value.trim();
  localStorage.setItem('rollarc.token', token);
  route();
});
$('#token').value = token;
window.addEventListener('hashchange', route);
route();
