"""UI-format ComfyUI workflows -> the API format the ComfyUI editor queues to POST /prompt.

Standard library only; scripts/queue_workflow.py uses it for --workflow files saved from the editor or taken from
ComfyUI's template menu. A UI-format file lists nodes with their widget values by position (`widgets_values`),
links as [id, from node, from slot, to node, to slot, type] and subgraph definitions under
`definitions.subgraphs`. The conversion needs the server's GET /object_info (every node class's inputs, in
order) and follows the editor's own graphToPrompt:

- Widget values get their names from the node's inputs in order (required, then optional, as `input_order`
  lists them). An input is a widget when its type is INT, FLOAT, STRING, BOOLEAN or COMBO (a list of choices) and
  it is not forceInput. The editor also stores values for widgets it adds itself and never sends: the
  control_after_generate menu after a seed/noise_seed INT (or any INT or COMBO flagged control_after_generate; a
  COMBO gets a filter field too) and the upload button of LoadImage-like nodes. The positional list wins, as in
  the editor's default setting; a `widgets_values` dict, or the `widgets_values_named` map newer editors save
  beside the list, is read by name only when there is no list, or when the class has dynamic combos (V3 choices
  whose options bring widgets of their own, sent as "choice.widget"). Widgets without a saved value take their
  default, as in the editor. List values are sent as {"__value__": [...]}.
- Subgraphs are inlined: a node inside subgraph instance 12 gets the id "12:5" (nested: "12:7:5"). A subgraph
  input left unconnected takes the instance's widget value (or, when it has none, the value of the first inner
  widget it feeds); legacy `proxyWidgets` values override the inner widgets they name.
- Reroute nodes pass their input on; a PrimitiveNode writes its value into the widgets it feeds (through
  reroutes too).
- Muted nodes (mode 2) are left out and so is every input that came from one. Bypassed nodes (mode 4) are left
  out and their consumers are wired to the bypassed node's input of the matching type (the same slot index if
  its type fits, else the first input of exactly that type, else the first compatible one), as the editor does.
  A muted or bypassed subgraph instance leaves out everything inside it.
- Note and MarkdownNote are left out, and so is any other node the server does not know that connects to nothing
  (listed in `notes`); any other node the server does not know stops the conversion with one sentence.
"""
from __future__ import annotations

from typing import NamedTuple

MODE_MUTED, MODE_BYPASS = 2, 4
SUBGRAPH_INPUT, SUBGRAPH_OUTPUT = "-10", "-20"  # the ids of a subgraph's input and output nodes in its links
FRONTEND_ONLY = frozenset({"Reroute", "PrimitiveNode", "Note", "MarkdownNote"})
WIDGET_TYPES = frozenset({"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"})
SEED_NAMES = ("seed", "noise_seed")  # INT widgets the editor gives a control_after_generate menu by name
UPLOAD_FLAGS = ("image_upload", "video_upload", "animated_image_upload")
DYNAMIC_COMBO = "COMFY_DYNAMICCOMBO_V3"  # a choice whose options bring widgets of their own ("choice.widget")
MAX_DEPTH = 32
_UNSET = object()


class ConversionError(ValueError):
    """The workflow cannot be converted; the message is one sentence that names the node and the fix."""


def is_ui_workflow(data) -> bool:
    return isinstance(data, dict) and isinstance(data.get("nodes"), list) and "links" in data


def convert(workflow: dict, object_info: dict) -> tuple[dict, list[str]]:
    """(API-format graph, notes on what was left out) for a UI-format workflow and the server's /object_info."""
    converter = Converter(workflow, object_info)
    return converter.graph(), converter.notes


# ---------------------------------------------------------------------------------------------------
# Node classes (/object_info entries): which inputs are widgets, in which order the editor stores them.

class InputDef(NamedTuple):
    name: str
    kind: object  # a type name, or a list of choices (a COMBO)
    options: dict
    optional: bool


def ordered_inputs(spec: dict) -> list[InputDef]:
    """The class's inputs in the editor's order: `input_order`'s required and optional lists, then the rest."""
    sections = spec.get("input") or {}
    order = spec.get("input_order") or {}
    names = [(s, n) for s in ("required", "optional") for n in order.get(s) or [] if n in (sections.get(s) or {})]
    names += [(s, n) for s in ("required", "optional") for n in sections.get(s) or {} if (s, n) not in names]
    out = []
    for section, name in names:
        entry = sections[section][name]
        entry = entry if isinstance(entry, (list, tuple)) else [entry]
        options = entry[1] if len(entry) > 1 and isinstance(entry[1], dict) else {}
        out.append(InputDef(name, entry[0] if entry else None, options, section == "optional"))
    return out


def is_combo(kind) -> bool:
    return isinstance(kind, list) or kind == "COMBO"


def is_widget(d: InputDef) -> bool:
    return (is_combo(d.kind) or d.kind in WIDGET_TYPES or d.kind == DYNAMIC_COMBO) and not d.options.get("forceInput")


def control_slots(d: InputDef) -> int:
    """Values the editor stores right after this widget for widgets of its own (not sent)."""
    if d.kind == "INT" and d.options.get("control_after_generate", d.name in SEED_NAMES):
        return 1  # control_after_generate
    if is_combo(d.kind) and d.options.get("control_after_generate"):
        return 2  # control_after_generate and control_filter_list
    return 0


def widget_slots(spec: dict) -> list[str | None]:
    """The names of `widgets_values` by position; None where the editor keeps a value of its own."""
    defs = ordered_inputs(spec)
    slots, upload_at = [], None
    for d in defs:
        if is_widget(d):
            slots += [d.name] + [None] * control_slots(d)
        if not d.optional:
            upload_at = len(slots)
    if any(not d.optional and is_combo(d.kind) and any(d.options.get(f) is True for f in UPLOAD_FLAGS) for d in defs):
        # the upload button: an input the editor adds after the required ones, placed after all of them when the
        # class lists its `input_order` (which does not name it)
        slots.insert(len(slots) if spec.get("input_order") else upload_at, None)
    return slots


def default_value(d: InputDef):
    if "default" in d.options:
        return d.options["default"]
    if is_combo(d.kind) or d.kind == DYNAMIC_COMBO:
        choices = d.kind if isinstance(d.kind, list) else d.options.get("options") or []
        choice = choices[0] if choices else _UNSET
        return choice.get("key", _UNSET) if isinstance(choice, dict) else choice
    return {"INT": 0, "FLOAT": 0, "STRING": "", "BOOLEAN": False}.get(d.kind, _UNSET)


def saved_widget_values(node: dict, spec: dict) -> dict:
    """A node's widget values by name: its saved values (by position; by name when the file has no list, or when
    the class has dynamic combos, whose option widgets are sent as "combo.widget"), else the defaults."""
    defs = ordered_inputs(spec)
    raw = node.get("widgets_values")
    named = raw if isinstance(raw, dict) else node.get("widgets_values_named")
    dynamic = {d.name for d in defs if d.kind == DYNAMIC_COMBO and is_widget(d)}
    if isinstance(raw, list) and not dynamic:
        values = {name: v for name, v in zip(widget_slots(spec), raw) if name is not None}
    elif isinstance(named, dict):
        values = dict(named)
    elif dynamic and raw:
        raise ConversionError(f"its class {spec.get('name') or node.get('type')!r} has dynamic widgets ("
                              f"{', '.join(sorted(dynamic))}), which this converter reads only by name, and the file "
                              f"has no widgets_values_named: open and save the workflow in a current ComfyUI editor.")
    else:
        values = {}
    out = {}
    for d in defs:
        if is_widget(d):
            value = values[d.name] if d.name in values else default_value(d)
            if value is not _UNSET:
                out[d.name] = value
    out.update((k, v) for k, v in values.items() if "." in k and k.split(".")[0] in dynamic)
    return out


def wrap(value):
    """The editor sends a list widget value wrapped, so that the server does not read it as a link."""
    return {"__value__": value} if isinstance(value, list) else value


# ---------------------------------------------------------------------------------------------------
# Link types, as the editor matches them when it wires a bypassed node's consumers.

def types_match(a, b) -> bool:
    """LiteGraph's isValidConnection: "*" or empty matches anything; "A,B" lists alternatives; case-insensitive."""
    a = None if a in ("", "*", 0, None) else str(a)
    b = None if b in ("", "*", 0, None) else str(b)
    if a is None or b is None or a == b:
        return True
    a, b = a.lower(), b.lower()
    if "," not in a and "," not in b:
        return a == b
    return any(types_match(x, y) for x in a.split(",") for y in b.split(","))


def bypass_input(inputs: list[dict], output_type, slot: int, kind) -> int:
    """Which input of a bypassed node feeds the consumers of its output `slot` (whose input type is `kind`);
    -1: none fits."""
    if not inputs:
        return -1
    if kind in (None, "", "*"):
        return slot if slot < len(inputs) else 0
    if slot < len(inputs):
        t = inputs[slot].get("type")
        if types_match(t, output_type) and types_match(t, kind):
            return slot
    for i, entry in enumerate(inputs):
        if entry.get("type") == kind:
            return i
    for i, entry in enumerate(inputs):
        if types_match(entry.get("type"), output_type) and types_match(entry.get("type"), kind):
            return i
    return -1


# ---------------------------------------------------------------------------------------------------
# The graph: scopes (the workflow and each subgraph definition) and the node instances placed in them.

class Link(NamedTuple):
    id: int
    origin_id: str
    origin_slot: int
    target_id: str
    target_slot: int
    type: object


def parse_link(raw) -> Link:
    if isinstance(raw, dict):
        raw = [raw.get(k) for k in ("id", "origin_id", "origin_slot", "target_id", "target_slot", "type")]
    return Link(raw[0], str(raw[1]), raw[2], str(raw[3]), raw[4], raw[5] if len(raw) > 5 else None)


class Scope:
    """One graph: the workflow itself or a subgraph definition (which also has `inputs` and `outputs`)."""

    def __init__(self, data: dict):
        self.data = data
        self.nodes = [n for n in data.get("nodes") or [] if isinstance(n, dict)]
        self.links = {link.id: link for link in (parse_link(raw) for raw in data.get("links") or [] if raw)}
        self.inputs = data.get("inputs") or []
        self.outputs = data.get("outputs") or []
        self.name = data.get("name") or data.get("id") or "the workflow"


class Instance:
    """A node at its place in the flattened graph; `parent` is the subgraph instance it sits in."""

    def __init__(self, node: dict, scope: Scope, parent: Instance | None):
        self.node, self.scope, self.parent = node, scope, parent
        self.id = f"{parent.id}:{node.get('id')}" if parent else str(node.get("id"))
        self.type = node.get("type")
        self.mode = node.get("mode") or 0
        self.subgraph: Scope | None = None  # the definition, for a subgraph instance
        self.depth = parent.depth + 1 if parent else 0

    def active(self) -> bool:
        return self.mode not in (MODE_MUTED, MODE_BYPASS) and (self.parent is None or self.parent.active())

    def entries(self) -> list[dict]:
        return [e for e in self.node.get("inputs") or [] if isinstance(e, dict)]

    def entry_for_link(self, link_id) -> dict | None:
        return next((e for e in self.entries() if e.get("link") == link_id), None)

    def live_inputs(self) -> list[dict]:
        """The inputs as the editor holds them: a subgraph instance has one per input of its definition (the
        file keeps only those with a link or a label)."""
        if self.subgraph is None:
            return self.entries()
        saved = {e.get("name"): e for e in self.entries()}
        return [dict(saved.get(d.get("name")) or {}, name=d.get("name"), type=d.get("type"))
                for d in self.subgraph.inputs]

    def output_type(self, slot: int):
        outputs = self.subgraph.outputs if self.subgraph is not None else self.node.get("outputs") or []
        return outputs[slot].get("type") if slot < len(outputs) else None

    def output_links(self, slot: int = 0) -> list:
        outputs = self.node.get("outputs") or []
        return list(outputs[slot].get("links") or []) if slot < len(outputs) else []

    def describe(self) -> str:
        return f"node {self.id} ({self.node.get('title') or self.type})"


def subgraph_definitions(workflow: dict) -> dict[str, dict]:
    """Every subgraph definition by id (definitions may nest their own `definitions`)."""
    found, todo = {}, [workflow]
    while todo:
        data = todo.pop()
        for d in (data.get("definitions") or {}).get("subgraphs") or []:
            if isinstance(d, dict) and d.get("id") not in found:
                found[d.get("id")] = d
                todo.append(d)
    return found


# ---------------------------------------------------------------------------------------------------
# The conversion.

class Converter:
    """Flattens a UI-format workflow and emits the API graph; see the module docstring for the rules."""

    def __init__(self, workflow: dict, object_info: dict):
        if not is_ui_workflow(workflow):
            raise ConversionError("this is not a UI-format workflow (a JSON object with `nodes` and `links`).")
        self.object_info = object_info or {}
        self.definitions = subgraph_definitions(workflow)
        self.scopes = {key: Scope(d) for key, d in self.definitions.items()}
        self.instances: dict[str, Instance] = {}
        self.notes: list[str] = []
        self.overrides: dict[str, dict] = {}  # instance id -> widget -> value (proxy widgets, primitives)
        self._own: dict[str, dict] = {}
        self._promoted: dict[str, dict] = {}
        self._place(Scope(workflow), None)

    def _place(self, scope: Scope, parent: Instance | None) -> None:
        if parent is not None and parent.depth >= MAX_DEPTH:
            raise ConversionError(f"subgraph {scope.name!r} is nested more than {MAX_DEPTH} deep (does it contain "
                                  f"itself?).")
        for node in scope.nodes:
            inst = Instance(node, scope, parent)
            self.instances[inst.id] = inst
            if isinstance(inst.type, str) and inst.type.startswith(("workflow>", "workflow/")):
                raise ConversionError(f"{inst.describe()} is a group node, which this converter does not expand: in "
                                      f"ComfyUI, convert it to a subgraph (right-click > Convert to Subgraph), save "
                                      f"the workflow and try again.")
            if inst.type in self.scopes:
                inst.subgraph = self.scopes[inst.type]
                self._place(inst.subgraph, inst)

    def child(self, parent: Instance | None, node_id) -> Instance | None:
        return self.instances.get(f"{parent.id}:{node_id}" if parent else str(node_id))

    # -- what gets emitted ------------------------------------------------------------------------------

    def graph(self) -> dict:
        self._check_classes()
        for inst in sorted(self.instances.values(), key=lambda i: i.depth):
            if inst.subgraph is not None:
                self._apply_proxy_widgets(inst)
        for inst in self.instances.values():
            if inst.type == "PrimitiveNode":
                self._apply_primitive(inst)
        out = {inst.id: self.emit(inst) for inst in self.instances.values() if self._emitted(inst)}
        for node in out.values():  # inputs from nodes left out (muted ones) are dropped, as the editor does
            for name, value in list(node["inputs"].items()):
                if isinstance(value, list) and len(value) == 2 and value[0] not in out:
                    del node["inputs"][name]
        return out

    def _emitted(self, inst: Instance) -> bool:
        return (inst.subgraph is None and inst.type not in FRONTEND_ONLY and inst.type in self.object_info
                and inst.active())

    def _check_classes(self) -> None:
        """Every node the server does not know: left out if it connects to nothing, else one sentence."""
        for inst in self.instances.values():
            if inst.subgraph is not None or inst.type in FRONTEND_ONLY or inst.type in self.object_info:
                continue
            if not inst.active():
                continue  # muted: never sent; bypassed: its links pass through without its class
            linked = any(e.get("link") is not None for e in inst.entries()) or any(
                o.get("links") for o in inst.node.get("outputs") or [] if isinstance(o, dict))
            if linked:
                raise ConversionError(
                    f"{inst.describe()} is not a node class this ComfyUI server knows (it is not in /object_info): "
                    f"install the custom nodes (or the newer ComfyUI) that provide {inst.type!r}, or bypass or "
                    f"delete the node in the workflow.")
            self.notes.append(f"left out {inst.describe()}: the server does not know it and it connects to nothing")

    def emit(self, inst: Instance) -> dict:
        spec = self.object_info[inst.type]
        inputs = {name: wrap(value) for name, value in self.widget_values(inst).items()}
        for entry in inst.entries():
            if entry.get("link") is None:
                continue
            got = self.resolve_input(inst, entry)
            if got is not None:
                inputs[entry.get("name")] = wrap(got[1]) if got[0] == "value" else [got[1], got[2]]
        title = inst.node.get("title") or spec.get("display_name") or inst.type
        return {"inputs": inputs, "class_type": inst.type, "_meta": {"title": title}}

    # -- widget values ------------------------------------------------------------------------------------

    def widget_values(self, inst: Instance) -> dict:
        """A node's widget values by name: saved ones, then proxy-widget and primitive overrides."""
        if inst.id not in self._own:
            spec = self.object_info.get(inst.type)
            try:
                self._own[inst.id] = saved_widget_values(inst.node, spec) if spec else dict(
                    inst.node.get("widgets_values_named") or {})
            except ConversionError as e:
                raise ConversionError(f"{inst.describe()}: {e}") from None
        values = dict(self._own[inst.id])
        for name, value in self.overrides.get(inst.id, {}).items():
            if name in values or inst.type not in self.object_info:
                values[name] = value
        return values

    def widget_value(self, inst: Instance, name: str):
        values = self.promoted(inst) if inst.subgraph is not None else self.widget_values(inst)
        return values.get(name, _UNSET)

    def promoted(self, inst: Instance) -> dict:
        """A subgraph instance's values for its inputs that feed widgets inside, by input name: the instance's
        own (saved by position or name), else the first inner widget's; primitives feeding it override both."""
        if inst.id in self._promoted:
            return self._promoted[inst.id]
        self._promoted[inst.id] = {}  # a guard against a definition that reaches itself
        sources = {}
        for sub_input in inst.subgraph.inputs:
            for link_id in sub_input.get("linkIds") or []:
                link = inst.subgraph.links.get(link_id)
                target = self.child(inst, link.target_id) if link else None
                entry = target.entry_for_link(link_id) if target else None
                if entry and isinstance(entry.get("widget"), dict):
                    sources[sub_input.get("name")] = (target, entry["widget"].get("name"))
                    break
        values = {name: self.widget_value(t, w) for name, (t, w) in sources.items()}
        values.update(self._host_values(inst, sources))
        values.update(self.overrides.get(inst.id, {}))
        self._promoted[inst.id] = {k: v for k, v in values.items() if v is not _UNSET}
        return self._promoted[inst.id]

    def _host_values(self, inst: Instance, sources: dict) -> dict:
        node = inst.node
        raw = node.get("widgets_values")
        if not isinstance(raw, list):
            named = raw if isinstance(raw, dict) else node.get("widgets_values_named")
            return {name: named[name] for name in sources if name in named} if isinstance(named, dict) else {}
        if (node.get("properties") or {}).get("proxyWidgets"):
            return {}  # legacy proxy widgets: see _apply_proxy_widgets
        out, i = {}, 0
        for name, (target, widget) in sources.items():  # one value per promoted input (older files: plus a
            if i < len(raw):                               # control_after_generate value after a seed)
                out[name] = raw[i]
            i += 1
            if len(raw) > len(sources) and self._has_control(target, widget):
                i += 1
        return out

    def _has_control(self, inst: Instance, widget: str) -> bool:
        spec = self.object_info.get(inst.type)
        return bool(spec) and any(d.name == widget and control_slots(d) for d in ordered_inputs(spec))

    def _apply_proxy_widgets(self, inst: Instance) -> None:
        """Legacy `properties.proxyWidgets`: the instance's widgets_values[i] is the value of entry i, an inner
        node's widget (or, for node "-1", the instance's input of that name)."""
        proxies = (inst.node.get("properties") or {}).get("proxyWidgets")
        raw = inst.node.get("widgets_values")
        if not isinstance(proxies, list) or not isinstance(raw, list):
            return
        for entry, value in zip(proxies, raw):
            if not isinstance(entry, (list, tuple)) or len(entry) < 2:
                continue
            target = inst.id if str(entry[0]) == "-1" else f"{inst.id}:{entry[0]}"
            self.overrides.setdefault(target, {})[entry[1]] = value

    def _apply_primitive(self, inst: Instance) -> None:
        """A PrimitiveNode's value goes into every widget it feeds, as the editor does before queueing."""
        raw = inst.node.get("widgets_values")
        if not isinstance(raw, list) or not raw:
            return
        for target, widget in self._widget_targets(inst, 0, set()):
            self.overrides.setdefault(target.id, {})[widget] = raw[0]

    def _widget_targets(self, inst: Instance, slot: int, seen: set):
        for link_id in inst.output_links(slot):
            link = inst.scope.links.get(link_id)
            target = self.child(inst.parent, link.target_id) if link else None
            if target is None or (target.id, link_id) in seen:
                continue
            seen.add((target.id, link_id))
            if target.type == "Reroute":
                yield from self._widget_targets(target, 0, seen)
                continue
            entry = target.entry_for_link(link_id)
            if entry and isinstance(entry.get("widget"), dict):
                yield target, entry["widget"].get("name")

    # -- links --------------------------------------------------------------------------------------------

    def resolve_input(self, inst: Instance, entry: dict, kind=None, seen: set | None = None):
        """Where an input of `inst` gets its value: ("link", node id, output slot), ("value", v), or None."""
        seen = set() if seen is None else seen
        link_id = entry.get("link")
        if link_id is None:
            return None
        link = inst.scope.links.get(link_id)
        if link is None:
            raise ConversionError(f"{inst.describe()}: its input {entry.get('name')!r} uses link {link_id}, which "
                                  f"is not in {inst.scope.name}.")
        if link.origin_id == SUBGRAPH_INPUT:
            return self._from_subgraph_input(inst.parent, link.origin_slot, seen)
        origin = self.child(inst.parent, link.origin_id)
        if origin is None:
            raise ConversionError(f"{inst.describe()}: its input {entry.get('name')!r} comes from node "
                                  f"{link.origin_id}, which is not in {inst.scope.name}.")
        return self.resolve_output(origin, link.origin_slot, kind or entry.get("type"), seen)

    def resolve_output(self, inst: Instance, slot: int, kind, seen: set):
        if (inst.id, slot) in seen:
            raise ConversionError(f"the links through {inst.describe()} go round in a circle.")
        seen.add((inst.id, slot))
        if inst.mode == MODE_BYPASS:
            inputs = inst.live_inputs()
            index = bypass_input(inputs, inst.output_type(slot), slot, kind)
            if index < 0 or index >= len(inputs):
                return None
            if inst.subgraph is not None and inputs[index].get("link") is None:
                return self._from_subgraph_input(inst, index, seen)
            return self.resolve_input(inst, inputs[index], None, seen)
        if inst.subgraph is not None:
            return self._from_subgraph_output(inst, slot, kind, seen)
        if inst.type == "Reroute":
            entries = inst.entries()
            return self.resolve_input(inst, entries[0], kind, seen) if entries else None
        if inst.type in FRONTEND_ONLY:
            return None  # a PrimitiveNode: its value is already in the widgets it feeds
        return ("link", inst.id, slot)

    def _from_subgraph_input(self, host: Instance, index: int, seen: set):
        """Input `index` of subgraph instance `host`: what is connected to it outside, else its widget value (also
        when what is connected is a PrimitiveNode, whose value is then the widget's)."""
        if index >= len(host.subgraph.inputs):
            raise ConversionError(f"a link inside {host.describe()} uses input {index} of subgraph "
                                  f"{host.subgraph.name!r}, which has {len(host.subgraph.inputs)}.")
        name = host.subgraph.inputs[index].get("name")
        entry = next((e for e in host.entries() if e.get("name") == name), None)
        if entry is not None and entry.get("link") is not None:
            got = self.resolve_input(host, entry, None, seen)
            if got is not None:
                return got
        values = self.promoted(host)
        return ("value", values[name]) if name in values else None

    def _from_subgraph_output(self, inst: Instance, slot: int, kind, seen: set):
        outputs = inst.subgraph.outputs
        if slot >= len(outputs):
            raise ConversionError(f"a link uses output {slot} of {inst.describe()}, whose subgraph has "
                                  f"{len(outputs)} outputs.")
        links = [inst.subgraph.links.get(i) for i in outputs[slot].get("linkIds") or []]
        link = next((link for link in links if link is not None), None)
        if link is None:
            return None
        if link.origin_id == SUBGRAPH_INPUT:
            return self._from_subgraph_input(inst, link.origin_slot, seen)
        inner = self.child(inst, link.origin_id)
        return self.resolve_output(inner, link.origin_slot, kind, seen) if inner else None
