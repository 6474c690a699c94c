"""Domain errors. Each maps to one status in the HTTP contract (see `http_status`)."""


class EdgedError(Exception):
    """Base of every error edged reports to a caller."""

    code = "internal"
    http_status = 500
    closes_connection = False
    """The request was not read to its end: the connection cannot carry another one."""


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
    """The admission queue, or the server's connection limit, is full; the caller should retry later."""

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


class NotFound(EdgedError):
    """No such route."""

    code = "not_found"
    http_status = 404


class MethodNotAllowed(EdgedError):
    """The route exists but not for this HTTP method."""

    code = "method_not_allowed"
    http_status = 405


class RequestTimeout(EdgedError):
    """The client did not send its request body in time."""

    code = "request_timeout"
    http_status = 408
    closes_connection = True


class BodyTooLarge(EdgedError):
    """The request body is over the configured byte limit."""

    code = "body_too_large"
    http_status = 413


class HttpVersionNotSupported(EdgedError):
    """An HTTP version other than 1.x, or audio asked for over HTTP/1.0 (it is streamed with
    chunked encoding, which an HTTP/1.0 client cannot be sent)."""

    code = "http_version_not_supported"
    http_status = 505


class CodingNotImplemented(EdgedError):
    """A transfer coding other than chunked (gzip, deflate ...): RFC 9112 6.1 asks for a 501."""

    code = "coding_not_implemented"
    http_status = 501
    closes_connection = True


class CompressedBody(EdgedError):
    """A request body with a Content-Encoding: edged reads plain bodies only (RFC 9110 15.5.16)."""

    code = "unsupported_content_encoding"
    http_status = 415
    closes_connection = True


class HeadersTooLarge(EdgedError):
    """The request line and headers are over the configured byte limit."""

    code = "headers_too_large"
    http_status = 431
    closes_connection = True


class ConfigError(EdgedError):
    """The configuration file or an override is invalid."""

    code = "bad_config"
    http_status = 500


class AlreadyRunning(EdgedError):
    """Another live daemon owns the socket; it is not taken over."""

    code = "already_running"
    http_status = 500


class Forbidden(EdgedError):
    """An administrative call from a peer that is neither root, the daemon's own user, nor in the
    admin group."""

    code = "forbidden"
    http_status = 403
