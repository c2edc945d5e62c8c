"""The runtime: worker processes, their control channel and watchdog, ranks and the process groups between them."""
