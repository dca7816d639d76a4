// SD Accel: run badges drawn on the pack's nodes, and the settings that control them.
//
// After each run, a node of this pack shows what its UI output said, never anything scraped from logs:
//   Accelerated KSampler   `sdaccel_report`: it/s, seconds, peak VRAM, what ran, what fell back (and why)
//   condition-map nodes    `sdaccel_cache`:  cache hits / misses, cache size on disk, seconds
//   other SD Accel nodes   `text`:           the node's own summary line(s) (Apply SD Accel, cache report)
// The badge sits inside the node, under its widgets; the node grows to make room for it.
//
// Works on the 2024 ComfyUI frontend (LiteGraph, app.ui.settings) and on the current Vue frontend
// (settings declared on the extension, read through app.extensionManager.setting).
import { app } from "../../scripts/app.js";

const EXTENSION = "SDAccel.Badges";
const NODE_PREFIX = "SDAccel";
export const SETTING_SHOW = "SDAccel.ShowBadges";
export const SETTING_DETAIL = "SDAccel.BadgeDetail";
export const DETAIL_LEVELS = ["compact", "full"];

const SETTINGS = [
  {
    id: SETTING_SHOW,
    category: ["SD Accel", "Node badges", "Show"],
    name: "Show run badges on SD Accel nodes",
    tooltip: "After each run, draw it/s, seconds, peak VRAM and what ran or fell back on Accelerated " +
      "KSampler, and cache hits, misses and size on the condition-map nodes.",
    type: "boolean",
    defaultValue: true,
    onChange: () => redrawAll(),
  },
  {
    id: SETTING_DETAIL,
    category: ["SD Accel", "Node badges", "Detail"],
    name: "Run badge detail",
    tooltip: "compact: numbers, then the names of what ran and what fell back. " +
      "full: one line per item, with the reason each fallback happened, and the run's notes.",
    type: "combo",
    options: DETAIL_LEVELS,
    defaultValue: "compact",
    onChange: () => redrawAll(),
  },
];

// ------------------------------------------------------------------------------------ settings
function settingValue(id, fallback) {
  let v;
  const store = app.extensionManager?.setting;   // current frontend
  if (store && typeof store.get === "function") {
    v = store.get(id);
  } else {
    v = app.ui?.settings?.getSettingValue?.(id, fallback);   // 2024 frontend
  }
  return v ?? fallback;
}

export function badgesShown() {
  return settingValue(SETTING_SHOW, true) !== false;
}

export function badgeDetail() {
  const v = settingValue(SETTING_DETAIL, "compact");
  return DETAIL_LEVELS.includes(v) ? v : "compact";
}

function registerLegacySettings() {
  // The current frontend registered SETTINGS from the extension object already (and then lists them in
  // settingsLookup too); the 2024 frontend ignores that field and needs addSetting. Its settings dialog
  // has no categories, so the names carry the pack's name.
  const ui = app.ui?.settings;
  if (!ui || typeof ui.addSetting !== "function") return;
  for (const s of SETTINGS) {
    if (ui.settingsLookup && s.id in ui.settingsLookup) continue;
    ui.addSetting({
      id: s.id, name: "SD Accel: " + s.name, type: s.type, defaultValue: s.defaultValue,
      tooltip: s.tooltip, options: s.options, onChange: s.onChange,
    });
  }
}

// ---------------------------------------------------------------------------------- formatting
const COLORS = { head: "#f2f2f2", ran: "#79d279", fell: "#f0b050", off: "#9a9a9a", note: "#9ab4ff", text: "#d8d8d8" };

function fix(x, digits = 2) {
  return typeof x === "number" && isFinite(x) ? x.toFixed(digits) : "–";
}

export function formatBytes(n) {
  if (typeof n !== "number" || !isFinite(n)) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return i === 0 ? `${n} B` : `${n.toFixed(1)} ${units[i]}`;
}

function plural(n, word) {
  return `${n} ${word}${n === 1 ? "" : word.endsWith("s") ? "es" : "s"}`;
}

// The rows of a badge (each {text, color, bold?}) from one node's UI output; null when it has nothing
// of ours. `detail` is "compact" or "full".
export function badgeRows(output, detail = "compact") {
  if (!output) return null;
  const report = last(output.sdaccel_report);
  if (report) return reportRows(report, detail);
  const cache = last(output.sdaccel_cache);
  if (cache) return cacheRows(cache);
  const text = output.text;
  if (Array.isArray(text) && text.length) {
    return text.flatMap((t) => String(t).split("\n")).filter((t) => t.trim())
      .map((t) => ({ text: t, color: COLORS.text }));
  }
  return null;
}

function last(list) {
  return Array.isArray(list) && list.length ? list[list.length - 1] : null;
}

function reportRows(r, detail) {
  const vram = r.peak_vram_gib == null ? "VRAM n/a (CPU)" : `${fix(r.peak_vram_gib)} GiB peak VRAM`;
  const rows = [{ text: `${fix(r.it_s)} it/s · ${fix(r.seconds)} s · ${vram}`, color: COLORS.head, bold: true }];
  const ran = Array.isArray(r.ran) ? r.ran : [];
  const fell = Object.entries(r.fell_back || {});
  const off = fell.filter(([, why]) => why === "off").map(([what]) => what);
  const failed = fell.filter(([, why]) => why !== "off");
  const notes = Array.isArray(r.notes) ? r.notes : [];
  const pool = memoryRow(r.memory);
  if (pool) rows.push(pool);
  if (detail === "full") {
    if (!ran.length) rows.push({ text: "✓ stock path only", color: COLORS.ran });
    for (const item of ran) rows.push({ text: `✓ ${item}`, color: COLORS.ran });
    for (const [what, why] of failed) rows.push({ text: `✗ ${what}: ${why}`, color: COLORS.fell });
    if (off.length) rows.push({ text: `off: ${off.join(", ")}`, color: COLORS.off });
    for (const n of notes) rows.push({ text: `• ${n}`, color: COLORS.note });
  } else {
    rows.push({ text: `ran: ${ran.join(", ") || "stock path only"}`, color: COLORS.ran });
    if (failed.length) rows.push({ text: `fell back: ${failed.map(([w]) => w).join(", ")}`, color: COLORS.fell });
    if (off.length) rows.push({ text: `off: ${off.join(", ")}`, color: COLORS.off });
    if (notes.length) rows.push({ text: plural(notes.length, "note") + " (full detail in settings)", color: COLORS.note });
  }
  return rows;
}

// The VRAM Pool's stages of this run (text encode, sampling), when the sampled model carries a pool.
function memoryRow(m) {
  const stages = m && Array.isArray(m.stages) ? m.stages : [];
  if (!stages.length) return null;
  const parts = stages.map((s) => s.peak_allocated == null ? `${s.stage} n/a`
    : `${s.stage} ${fix(s.peak_allocated / 2 ** 30)} GiB`);
  return { text: `VRAM Pool peaks: ${parts.join(" · ")}`, color: COLORS.text };
}

function cacheRows(c) {
  return [
    { text: `cache: ${plural(c.hits ?? 0, "hit")}, ${plural(c.misses ?? 0, "miss")} · ${fix(c.seconds)} s`,
      color: COLORS.head, bold: true },
    { text: `cache size on disk: ${formatBytes(c.cache_bytes)}`, color: COLORS.text },
  ];
}

// ------------------------------------------------------------------------------------- drawing
const FONT_PX = 12;
const LINE_H = 16;
const PAD = 6;      // inside the badge box
const MARGIN = 6;   // between the node's edge and the box
const MAX_LINES_PER_ROW = 4;

let measureCtx = null;
function measurer() {
  if (!measureCtx) measureCtx = document.createElement("canvas").getContext("2d");
  return measureCtx;
}

function fontFor(row) {
  return `${row.bold ? "bold " : ""}${FONT_PX}px Arial, sans-serif`;
}

// Word-wraps the rows to `width` pixels; a row longer than MAX_LINES_PER_ROW lines ends in "…".
function wrapRows(rows, width) {
  const ctx = measurer();
  const out = [];
  for (const row of rows) {
    ctx.font = fontFor(row);
    const words = row.text.split(/(?<=[ ,;])/);
    const lines = [];
    let cur = "";
    for (const w of words) {
      if (cur && ctx.measureText(cur + w).width > width) { lines.push(cur.trimEnd()); cur = w.trimStart(); }
      else cur += w;
      while (ctx.measureText(cur).width > width && cur.length > 1) {   // one word wider than the box
        let cut = cur.length - 1;
        while (cut > 1 && ctx.measureText(cur.slice(0, cut)).width > width) cut--;
        lines.push(cur.slice(0, cut));
        cur = cur.slice(cut);
      }
    }
    if (cur) lines.push(cur);
    if (lines.length > MAX_LINES_PER_ROW) {
      lines.length = MAX_LINES_PER_ROW;
      let t = lines[MAX_LINES_PER_ROW - 1];
      while (t.length > 1 && ctx.measureText(t + "…").width > width) t = t.slice(0, -1);
      lines[MAX_LINES_PER_ROW - 1] = t + "…";
    }
    for (const l of lines) out.push({ ...row, text: l });
  }
  return out;
}

function badgeLines(node) {
  const b = node.sdaccelBadge;
  if (!b || !badgesShown()) return null;
  const detail = badgeDetail();
  if (b.detail !== detail || b.width !== node.size[0]) {
    b.detail = detail;
    b.width = node.size[0];
    b.rows = badgeRows(b.output, detail) || [];
    b.lines = wrapRows(b.rows, Math.max(40, node.size[0] - 2 * (MARGIN + PAD)));
  }
  return b.lines.length ? b.lines : null;
}

function badgeHeight(lines) {
  return lines.length * LINE_H + 2 * PAD + MARGIN;
}

function drawBadge(node, ctx, baseHeight) {
  if (node.flags?.collapsed) return;
  const lines = badgeLines(node);
  if (!lines) return;
  const b = node.sdaccelBadge;
  const x = MARGIN;
  const y = baseHeight;
  const w = node.size[0] - 2 * MARGIN;
  const h = lines.length * LINE_H + 2 * PAD;
  ctx.save();
  ctx.beginPath();
  if (ctx.roundRect) ctx.roundRect(x, y, w, h, 5);
  else ctx.rect(x, y, w, h);
  ctx.fillStyle = "rgba(0, 0, 0, 0.55)";
  ctx.fill();
  ctx.strokeStyle = "rgba(121, 210, 121, 0.6)";
  ctx.lineWidth = 1;
  ctx.stroke();
  ctx.textAlign = "left";
  ctx.textBaseline = "middle";
  lines.forEach((line, i) => {
    ctx.font = fontFor(line);
    ctx.fillStyle = line.color;
    ctx.fillText(line.text, x + PAD, y + PAD + i * LINE_H + LINE_H / 2);
  });
  ctx.restore();
  b.drawnLines = lines.map((l) => l.text);   // what is on screen now (read by the browser tests)
  b.drawCount = (b.drawCount || 0) + 1;
}

function redrawAll() {
  // called from a setting's onChange, which may run before the new value is stored: next tick
  setTimeout(redrawNow, 0);
}

function redrawNow() {
  const graph = app.graph;
  if (!graph) return;
  for (const node of graph._nodes || graph.nodes || []) {
    if (node.sdaccelBadge) fitNode(node);
  }
  graph.setDirtyCanvas?.(true, true);
}

function fitNode(node) {
  const s = node.computeSize();
  const w = Math.max(node.size[0], s[0]);
  const h = Math.max(node.size[1], s[1]);
  if (w !== node.size[0] || h !== node.size[1]) node.setSize([w, h]);
}

function hookNodeType(nodeType) {
  const proto = nodeType.prototype;
  if (proto.sdaccelBadges) return;
  proto.sdaccelBadges = true;
  // The 2024 frontend gives the prototype LGraphNode's methods only after this hook (registerNodeType
  // copies them where missing), so the inherited computeSize is looked up at call time there.
  const inherited = proto.computeSize;
  const baseCompute = function () {
    return (inherited || globalThis.LiteGraph.LGraphNode.prototype.computeSize).apply(this, arguments);
  };
  const baseHeight = (node) => baseCompute.call(node)[1];

  proto.computeSize = function (out) {
    const size = baseCompute.apply(this, arguments);
    const lines = badgeLines(this);
    if (lines && !this.flags?.collapsed) size[1] += badgeHeight(lines);
    return size;
  };

  const onExecuted = proto.onExecuted;
  proto.onExecuted = function (output) {
    const r = onExecuted?.apply(this, arguments);
    if (badgeRows(output)) {
      this.sdaccelBadge = { output, received: Date.now() };
      fitNode(this);
      this.setDirtyCanvas?.(true, true);
    }
    return r;
  };

  const onDrawForeground = proto.onDrawForeground;
  proto.onDrawForeground = function (ctx) {
    const r = onDrawForeground?.apply(this, arguments);
    if (this.sdaccelBadge) {
      const top = baseHeight(this);
      const lines = badgeLines(this);
      if (lines && top + badgeHeight(lines) > this.size[1] + 0.5) fitNode(this);   // detail or width changed
      drawBadge(this, ctx, top);
    }
    return r;
  };
}

// Current ComfyUI serves this folder twice when the pack's folder name differs from the project name
// in pyproject.toml ([tool.comfy] web, plus WEB_DIRECTORY): the second copy must not register again.
if (!(app.extensions || []).some((e) => e.name === EXTENSION)) {
  app.registerExtension({
    name: EXTENSION,
    settings: SETTINGS,   // current frontend: registered (and persisted) from here
    init() {
      registerLegacySettings();   // 2024 frontend
    },
    async beforeRegisterNodeDef(nodeType, nodeData) {
      if (nodeData?.name?.startsWith(NODE_PREFIX)) hookNodeType(nodeType);
    },
  });
}
