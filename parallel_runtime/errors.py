"""Errors the runtime raises. Each message is one sentence that names the fix."""


class ParaDiTError(RuntimeError):
    """Base class: anything the user can act on."""


class ConfigError(ParaDiTError, ValueError):
    """Bad input detected before any work starts (degrees, resolution, sampler, ...)."""


class ModelFileError(ParaDiTError):
    """A checkpoint that is missing, corrupt, or not a supported DiT."""


class WorkerError(ParaDiTError):
    """A worker died or failed mid-job; the client has torn the workers down."""


class OutOfMemory(ParaDiTError):
    """A worker ran out of device memory."""


class Cancelled(ParaDiTError):
    """The job was cancelled by the user."""
