"""Domain errors. Each maps to one status in the HTTP contract (see `http_status`)."""


class EdgedError(Exception):
    """Base of every error edged reports to a caller."""

    code = "internal"
    http_status = 500


class BadInput(EdgedError):
    """The request itself is wrong: empty text, bad option value, malformed body."""

    code = "bad_request"
    http_status = 400


class TextTooLong(EdgedError):
    """The text is over the configured character limit."""

    code = "text_too_long"
    http_status = 413


class UnknownVoice(EdgedError):
    """No voice with that id or directory is installed."""

    code = "unknown_voice"
    http_status = 404


class BundleError(EdgedError):
    """A voice bundle is missing a file, fails its checksum or is malformed."""

    code = "bad_bundle"
    http_status = 500


class Busy(EdgedError):
    """The admission queue is full; the caller should retry later."""

    code = "busy"
    http_status = 503


class NotReady(EdgedError):
    """The daemon is still loading or is draining."""

    code = "not_ready"
    http_status = 503


class StageTimeout(EdgedError):
    """A pipeline stage took longer than its configured timeout."""

    code = "timeout"
    http_status = 503
