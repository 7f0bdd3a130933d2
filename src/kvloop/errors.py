"""The errors kvloop raises for user mistakes. All are ``ValueError`` subclasses, so callers
can catch one type; the CLI turns them into one line and exit status 2."""


class KvloopError(ValueError):
    """A user-facing problem: bad input, a bad file, an unsupported model.

    `param` names the offending field when there is one (the server reports it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelLoadError(KvloopError):
    """The model path is missing, is not a model, or uses something kvloop does not support."""


class InvalidParamsError(KvloopError):
    """A sampling or engine parameter is out of range."""


class PromptTooLongError(KvloopError):
    """The prompt does not fit the model's context (or, where asked, prompt + max_tokens
    does not), or could never fit the KV cache."""


class RemoteError(Exception):
    """The resident engine could not answer (gone, refused the key, failed): exit 1. Here
    rather than in kvloop.client, so that the one-shot CLI need not import the client."""
