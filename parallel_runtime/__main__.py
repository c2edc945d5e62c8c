"""Commands: `python -m parallel_runtime demo | bench | bench-storage | bench-vae | soak | agent`."""
import sys


def main(argv: list[str]) -> int:
    commands = {"demo": "parallel_runtime.demo", "bench": "parallel_runtime.bench.cli",
                "bench-storage": "parallel_runtime.bench.storage", "soak": "parallel_runtime.soak",
                "bench-vae": "parallel_runtime.bench.vae_split", "agent": "parallel_runtime.runtime.agent"}
    if not argv or argv[0] not in commands:
        print("usage: python -m parallel_runtime {demo,bench,bench-storage,bench-vae,soak,agent} [options]  (add --help to a "
              "command)")
        return 2
    import importlib

    return importlib.import_module(commands[argv[0]]).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
