// SD Accel: keep the API-format twins of our workflows out of ComfyUI's template browser.
//
// ComfyUI (0.3.x) lists every `*.json` in a pack's workflows/ folder as a template, keyed by the pack's
// folder in custom_nodes. Ours come in pairs: `X.json` (UI format: the template) and `X.api.json` (API
// format, for scripts and tests). The frontend opens only UI-format files as templates, so an "X.api"
// entry would fail with an error when clicked. This extension drops the names ending in ".api" from
// this pack's own entry; other packs' templates and ComfyUI's own pass through untouched. Frontends
// without a template browser (ComfyUI 2024) have no getWorkflowTemplates, so nothing changes there.
import { api } from "../../scripts/api.js";
import { app } from "../../scripts/app.js";

const EXTENSION = "SDAccel.Templates";
const API_SUFFIX = ".api";
const THIS_FILE = "sdaccel_templates.js";

// The custom_nodes folder an extension URL belongs to: /extensions/<folder>/.../<file>.js -> <folder>.
export function extensionFolder(url) {
  const parts = new URL(url, "http://x").pathname.split("/").map(decodeURIComponent);
  const i = parts.lastIndexOf("extensions");
  return i >= 0 && i + 2 < parts.length ? parts[i + 1] : null;
}

export function withoutApiTwins(templates, folders) {
  if (!templates || typeof templates !== "object") return templates;
  const out = { ...templates };
  for (const key of Object.keys(out)) {
    if (folders.has(key) && Array.isArray(out[key])) {
      out[key] = out[key].filter((n) => !String(n).endsWith(API_SUFFIX));
    }
  }
  return out;
}

// Every folder this file is served from. Usually one; current ComfyUI serves the js/ folder a second
// time under the pyproject name when it differs from the folder name, and only the folder name keys the
// templates, so both are collected.
async function ourFolders() {
  const folders = new Set([extensionFolder(import.meta.url)]);
  try {
    for (const url of await api.getExtensions()) {
      if (url.endsWith("/" + THIS_FILE)) folders.add(extensionFolder(url));
    }
  } catch (e) {
    console.warn("[SD Accel] could not list extensions; filtering templates of this folder only", e);
  }
  folders.delete(null);
  return folders;
}

function installFilter() {
  const base = api.getWorkflowTemplates;
  if (typeof base !== "function" || base.sdaccelFiltered) return;
  const filtered = async function (...args) {
    const [templates, folders] = await Promise.all([base.apply(this, args), ourFolders()]);
    return withoutApiTwins(templates, folders);
  };
  filtered.sdaccelFiltered = true;
  api.getWorkflowTemplates = filtered;
}

// See sdaccel_badges.js: the folder may be served twice; register once.
if (!(app.extensions || []).some((e) => e.name === EXTENSION)) {
  app.registerExtension({
    name: EXTENSION,
    init() {
      installFilter();
    },
  });
}
