"""How ranks are laid out and talk: the devices they run on (`devices`), the parallel dimensions' rank layout and
its validation (`topology`), PipeFusion's stage split (`stages`), the only torch.distributed calls (`comm`, with
`streams`) and what differs per platform in starting them (`portability`). Strategies, planning and the runtime
build on it; it imports no model, strategy or runtime module."""
