// ParaDiT frontend: draws the live "paradit.status" events of the Parallel Sampler onto the ParaDiT
// nodes: strategy (and why, in auto mode), per-device worker state and memory, seconds per step.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const EVENT = "paradit.status";
const NODE_TYPES = new Set(["ParaDiTStrategy", "ParaDiTLoader", "ParaDiTSampler"]);
const LINE_H = 14;
const PAD = 6;
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
    const parts = [`rank ${w.rank} ${w.device}: ${w.alive ? "up" : "DOWN"}`];
    if (w.rss_bytes !== null && w.rss_bytes !== undefined) parts.push(`RAM ${gib(w.rss_bytes)}`);
    if (w.device_bytes !== null && w.device_bytes !== undefined) parts.push(`dev ${gib(w.device_bytes)}`);
    lines.push({
      text: parts.join(" · "),
      color: w.alive ? "#ccc" : COLORS.error,
    });
  }
  if (d.message) lines.push({ text: d.message, color: COLORS[d.state] ?? "#ccc" });
  return lines;
}

function strategyLines(d) {
  const lines = [{ text: `${d.mode}: ${d.strategy} on ${d.world_size} worker(s)`, color: COLORS.done }];
  if (d.reason && d.reason !== "manual") lines.push({ text: d.reason, color: "#aaa" });
  return lines;
}

// Two kinds of lines per node: the last status event, and the text of the node's own last run.
function setLines(node, lines, kind = "status") {
  if (!node) return;
  node.paradit = node.paradit || { status: [], executed: [] };
  node.paradit[kind] = lines;
  node.paraditLines = [...node.paradit.status, ...node.paradit.executed];
  const need = node.computeSize()[1] + node.paraditLines.length * LINE_H + PAD * 2;
  if (node.size[1] < need) node.setSize([node.size[0], need]);
  node.setDirtyCanvas(true, true);
}

function onStatus(event) {
  const d = event.detail;
  if (!d) return;
  setLines(findNode(d.node), samplerLines(d));
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
      ctx.save();
      ctx.font = "11px monospace";
      ctx.textAlign = "left";
      ctx.textBaseline = "top";
      lines.forEach((line, i) => {
        ctx.fillStyle = line.color || "#ccc";
        ctx.fillText(line.text, PAD + 4, top + i * LINE_H, this.size[0] - 2 * PAD);
      });
      ctx.restore();
      return r;
    };
  },
});
