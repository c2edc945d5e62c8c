"""ComfyUI nodes of ParaDiT. Importing this package imports neither ComfyUI nor the node modules;
`node_list()` does, when ComfyUI asks for the nodes."""


def node_list() -> list:
    from . import front_door
    from .loader import ParaDiTLoader
    from .routes import register_routes
    from .sampler import ParaDiTSampler
    from .strategy import ParaDiTStrategy
    from .vae_decode import ParaDiTVAEDecode

    register_routes()
    front_door.open_at_load()  # other machines' agents may join before the first prompt (where one is configured)

    return [ParaDiTStrategy, ParaDiTLoader, ParaDiTSampler, ParaDiTVAEDecode]
