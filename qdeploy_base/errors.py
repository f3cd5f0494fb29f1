"""The project's small error hierarchy. The CLI turns a QdeployError into one line and exit code 2;
anything else is an internal error (exit code 1). The str of an error is the whole user-facing message, so
it names the file, node or tensor and the value seen."""


class QdeployError(Exception):
    """Base of every error a user can cause: bad input or an unsupported model."""


class BadInput(QdeployError):
    """A file, array, flag or model that is malformed or inconsistent."""


class Unsupported(QdeployError):
    """A valid model that uses something qdeploy does not handle (op, attribute value, opset)."""


def one_line(message: str) -> str:
    """`message` with every non-printable character (a newline or NUL inside a name read from a damaged file)
    written as its escape, so that the CLI's `error: ...` stays on one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)
