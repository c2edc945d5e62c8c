"""The front door other machines' agents join, opened when ComfyUI loads the plugin (not at the first prompt that
names another machine), so agents can join, and show in the status, before any prompt.

Where it listens comes from the environment (PARADIT_LISTEN, PARADIT_KEY_FILE), else from `cluster.json` in
`<ComfyUI user dir>/paradit/`: {"listen": "192.168.1.10:29600", "key_file": "paradit.key"}, key_file relative to
that folder. The file's values go into the environment, so the runtime's own front_door() stays the one place that
opens the door from one set of settings: a door that failed to open is retried, with the same sentence, wherever
the runtime asks for it, and opens once its cause is fixed (a port freed, a key file chmod'ed) without a restart.
The environment wins over the file: it is what the user set for this one process.
"""
from __future__ import annotations

import json
import logging
import os

log = logging.getLogger("paradit")

CONFIG_FOLDER = "paradit"
CONFIG_FILE = "cluster.json"

_load_problem: str | None = None  # why the door did not open at the last try, repeated by the nodes that need it
_source = "PARADIT_LISTEN and PARADIT_KEY_FILE"  # where the settings came from, for the sentences
_from_file: dict[str, str] = {}  # the settings this module put into the environment from cluster.json


def config_path() -> str | None:
    """`<ComfyUI user dir>/paradit/cluster.json` (None outside ComfyUI)."""
    try:
        import folder_paths

        return os.path.join(folder_paths.get_user_directory(), CONFIG_FOLDER, CONFIG_FILE)
    except (ImportError, AttributeError):
        return None


def settings_from_file(path: str) -> dict[str, str]:
    """PARADIT_LISTEN and PARADIT_KEY_FILE as cluster.json at `path` gives them (key_file made absolute)."""
    from parallel_runtime.errors import ConfigError

    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} cannot be read ({exc}): write it as JSON, e.g. {{\"listen\": "
                          f"\"192.168.1.10:29600\", \"key_file\": \"paradit.key\"}}.") from None
    if not (isinstance(config, dict) and isinstance(config.get("listen"), str)
            and isinstance(config.get("key_file"), str) and config["listen"] and config["key_file"]):
        raise ConfigError(f"{path} must hold {{\"listen\": \"ADDRESS:PORT\", \"key_file\": \"FILE\"}} (the key file "
                          f"relative to that folder), e.g. {{\"listen\": \"192.168.1.10:29600\", \"key_file\": "
                          f"\"paradit.key\"}}.")
    return {"PARADIT_LISTEN": config["listen"].strip(),
            "PARADIT_KEY_FILE": os.path.join(os.path.dirname(path), config["key_file"])}


def open_at_load() -> None:
    """Open the front door if the environment or cluster.json asks for one. Never raises: a failure must not keep
    ComfyUI from loading the nodes; it is logged in one sentence and repeated by `door()`."""
    global _load_problem, _source
    _load_problem, _source = None, "PARADIT_LISTEN and PARADIT_KEY_FILE"
    try:
        path = config_path()
        users = os.environ.get("PARADIT_LISTEN") not in (None, "", _from_file.get("PARADIT_LISTEN"))
        if not users and path and os.path.isfile(path):
            _source = path
            _from_file.update(settings_from_file(path))
            os.environ.update(_from_file)
        if os.environ.get("PARADIT_LISTEN"):
            from parallel_runtime.runtime.cluster import front_door

            front_door()  # logs the address agents join at; returns the open one on later calls
    except Exception as exc:  # ComfyUI drops every node of a plugin whose entry point raises
        _load_problem = f"{str(exc).rstrip('.')} (settings from {_source})"
        log.warning("ParaDiT: other machines cannot join this one: %s.", _load_problem)


def door():
    """This process's front door, for a devices string that names other machines; else one sentence saying why
    there is none. Each call retries (cluster.json read again), so a cause fixed since ComfyUI loaded (the file
    written or corrected, a port freed, a key file chmod'ed) needs no restart."""
    from parallel_runtime.errors import ConfigError
    from parallel_runtime.runtime.cluster import front_door

    open_at_load()
    if _load_problem:
        raise ConfigError(f"devices names other machines, but this host's front door did not open: {_load_problem}.")
    found = front_door()
    if found is None:
        where = config_path() or f"<ComfyUI user folder>/{CONFIG_FOLDER}/{CONFIG_FILE}"
        raise ConfigError(f"devices names other machines, but this host has no front door for their agents: write "
                          f"{where} as {{\"listen\": \"ADDRESS:PORT\", \"key_file\": \"paradit.key\"}} (this "
                          f"machine's private address and a port, e.g. 192.168.1.10:29600; the key made with `python "
                          f"-m parallel_runtime agent --new-key FILE`, copied to each agent's machine), or set "
                          f"PARADIT_LISTEN and PARADIT_KEY_FILE.")
    return found
