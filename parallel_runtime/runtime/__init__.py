"""The runtime: the client, the worker processes, their control channel, link checks and watchdog."""
