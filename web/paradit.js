// ParaDiT frontend: draws the live "paradit.status" events of the Parallel Sampler onto the ParaDiT
// nodes: strategy (and why, in auto mode), per-device worker state and memory (each rank with its host),
// seconds per step, and other machines' agents where the workers run on them.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const EVENT = "paradit.status";
const NODE_TYPES = new Set(["ParaDiTStrategy", "ParaDiTLoader", "ParaDiTSampler"]);
const LINE_H = 14;
const PAD = 6;
const MAX_W = 420; // widest a node grows to fit its lines; longer lines wrap at its width
const COLORS = { starting: "#8ab4f8", running: "#8ab4f8", done: "#81c995", cancelled: "#fdd663", error: "#f28b82" };

function gib(bytes) {
  if (bytes === null || bytes === undefined) return "?";
  return (bytes / 2 ** 30).toFixed(bytes >= 2 ** 30 ? 1 : 2) + " GiB";
}

function findNode(id) {
  if (id === null || id === undefined) return null;
  const graph = app.graph;
  if (!graph) return null;
  // Ids inside subgraphs look like "12:5"; the last part is the node in its own graph.
  const last = String(id).split(":").pop();
  return graph.getNodeById(id) ?? graph.getNodeById(Number(last)) ?? null;
}

function samplerLines(d) {
  const s = d.status || {};
  const head = [d.strategy ?? "?", d.state];
  if (d.total) head.push(`${d.step ?? 0}/${d.total}`);
  const sps = s.sec_per_step ?? (d.info || {}).sec_per_step;
  if (typeof sps === "number") head.push(`${sps.toFixed(2)} s/step`);
  const lines = [{ text: head.join(" · "), color: COLORS[d.state] }];
  if (d.mode === "auto" && d.reason) lines.push({ text: `auto: ${d.reason}`, color: "#aaa" });
  for (const w of s.workers || []) {
    // Before the first job the pool is not spawned yet: "starting", not a dead worker.
    const pending = !w.alive && d.state === "starting";
    // w.device is the rank's label: "cuda:0" here, "box-b cpu" on another machine (w.host names it).
    const parts = [`rank ${w.rank} ${w.device}: ${w.alive ? "up" : pending ? "starting" : "DOWN"}`];
    if (w.rss_bytes !== null && w.rss_bytes !== undefined) parts.push(`RAM ${gib(w.rss_bytes)}`);
    // CPU workers have no device memory of their own (always 0): leave it out there.
    const cpu = /(^| )cpu(:\d+)?$/.test(String(w.device ?? ""));
    if (w.device_bytes !== null && w.device_bytes !== undefined && !cpu) parts.push(`dev ${gib(w.device_bytes)}`);
    lines.push({
      text: parts.join(" · "),
      color: w.alive ? "#ccc" : pending ? "#aaa" : COLORS.error,
    });
  }
  lines.push(...clusterLines(s.cluster));
  if (d.message) lines.push({ text: d.message, color: COLORS[d.state] ?? "#ccc" });
  return lines;
}

// Other machines' agents (status "cluster", where ranks run on them): one line each, and the last refusal.
function clusterLines(c) {
  if (!c) return [];
  const lines = (c.agents || []).map((a) => a.alive
    ? { text: `host ${a.name} (${a.peer}): joined` + (typeof a.link_mb_s === "number" ? ` · ${a.link_mb_s} MB/s` : ""),
        color: "#ccc" }
    : { text: `host ${a.name}: LOST (${a.lost})`, color: COLORS.error });
  const refused = (c.refusals || []).at(-1);
  if (refused) lines.push({ text: `front door: ${refused}`, color: COLORS.cancelled });
  return lines;
}

function strategyLines(d) {
  const lines = [{ text: `${d.mode}: ${d.strategy} on ${d.world_size} worker(s)`, color: COLORS.done }];
  if (d.reason && d.reason !== "manual") lines.push({ text: d.reason, color: "#aaa" });
  return lines;
}

// Two kinds of lines per node: the last status event, and the text of the node's own last run.
const FONT = "11px monospace";
let measureCtx = null;
function textWidth(text) {
  measureCtx = measureCtx || document.createElement("canvas").getContext("2d");
  measureCtx.font = FONT;
  return measureCtx.measureText(text).width;
}

// Text the frontend already shows on the node: the "progress text" preview widget that
// ComfyUI draws for server.send_progress_text (the Strategy Selector's description).
function shownByFrontend(node) {
  const shown = new Set();
  for (const w of node.widgets ?? []) {
    if (w.name === "$$node-text-preview" && w.value) String(w.value).split("\n").forEach((t) => shown.add(t));
  }
  return shown;
}

// Breaks one line into lines of at most `width` pixels, at spaces where it can.
function wrap(line, width) {
  if (textWidth(line.text) <= width) return [line];
  const out = [];
  let cur = "";
  for (const word of line.text.split(" ")) {
    const next = cur ? cur + " " + word : word;
    if (!cur || textWidth(next) <= width) { cur = next; continue; }
    out.push(cur);
    cur = word;
  }
  if (cur) out.push(cur);
  return out.map((text) => ({ text, color: line.color }));
}

function refresh(node) {
  const shown = shownByFrontend(node);
  const seen = new Set();
  // Where the frontend shows the server's text itself (progress-text preview), drawing ours too
  // would repeat it and overlap that widget.
  const lines = shown.size ? [] : [...node.paradit.status, ...node.paradit.executed].filter((l) => {
    if (!l.text || seen.has(l.text)) return false;
    seen.add(l.text);
    return true;
  });
  const minSize = node.computeSize();
  const widest = Math.max(0, ...lines.map((l) => textWidth(l.text)));
  const width = Math.max(node.size[0], Math.min(MAX_W, Math.ceil(widest) + 2 * (PAD + 4)));
  node.paraditLines = lines.flatMap((l) => wrap(l, width - 2 * (PAD + 4)));
  const height = minSize[1] + node.paraditLines.length * LINE_H + PAD * 2;
  if (node.size[0] < width || node.size[1] < height) {
    node.setSize([Math.max(node.size[0], width), Math.max(node.size[1], height)]);
  }
  node.setDirtyCanvas(true, true);
}

function setLines(node, lines, kind = "status") {
  if (!node) return;
  node.paradit = node.paradit || { status: [], executed: [] };
  node.paradit[kind] = lines;
  refresh(node);
}

function onStatus(event) {
  const d = event.detail;
  if (!d) return;
  const sampler = findNode(d.node);
  // A new run: the summary of the previous one no longer describes what the node shows.
  if (d.state === "starting" && sampler?.paradit) sampler.paradit.executed = [];
  setLines(sampler, samplerLines(d));
  if (d.strategy_node !== null && d.strategy_node !== undefined && d.strategy) {
    setLines(findNode(d.strategy_node), strategyLines(d));
  }
  // Every loader pointing at the same worker pool shows its workers too.
  for (const node of app.graph?._nodes ?? []) {
    if (node.comfyClass !== "ParaDiTLoader") continue;
    const w = node.widgets?.find((x) => x.name === "devices");
    const devices = String(w?.value ?? "auto").replace(/\s/g, "") || "auto";
    if (devices === d.devices) setLines(node, samplerLines(d));
  }
}

// Workers keep their weights between prompts; these give the memory back on request.
async function postAndReport(path, what) {
  const res = await api.fetchApi(path, { method: "POST" });
  const body = await res.json().catch(() => ({}));
  console.log(`ParaDiT: ${what} (${body.clients ?? 0} worker pool(s))`);
}

app.registerExtension({
  name: "ParaDiT.status",
  commands: [
    { id: "ParaDiT.release", label: "ParaDiT: release worker weights",
      function: () => postAndReport("/paradit/release", "released worker weights") },
    { id: "ParaDiT.shutdown", label: "ParaDiT: stop workers",
      function: () => postAndReport("/paradit/shutdown", "stopped workers") },
  ],
  menuCommands: [{ path: ["Extensions", "ParaDiT"], commands: ["ParaDiT.release", "ParaDiT.shutdown"] }],
  setup() {
    api.addEventListener(EVENT, onStatus);
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!NODE_TYPES.has(nodeData.name)) return;

    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      const text = message?.text;
      if (text && text.length) {
        setLines(this, String(text[0]).split("\n").map((t) => ({ text: t, color: "#ccc" })), "executed");
      }
    };

    const onDrawForeground = nodeType.prototype.onDrawForeground;
    nodeType.prototype.onDrawForeground = function (ctx) {
      const r = onDrawForeground?.apply(this, arguments);
      const lines = this.paraditLines;
      if (!lines || !lines.length || this.flags?.collapsed) return r;
      const top = this.size[1] - lines.length * LINE_H - PAD;
      const x = PAD + 4;
      ctx.save();
      ctx.font = FONT;
      ctx.textAlign = "left";
      ctx.textBaseline = "top";
      lines.forEach((line, i) => {
        ctx.fillStyle = line.color || "#ccc";
        ctx.fillText(line.text, x, top + i * LINE_H, Math.max(1, this.size[0] - 2 * x));
      });
      ctx.restore();
      return r;
    };
  },
});
