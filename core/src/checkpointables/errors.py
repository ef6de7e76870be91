"""Errors raised by checkpointables.

Every library error derives from :class:`CheckpointError`. Where a builtin
exception already carries the meaning (a missing path, an existing path, a
checkpointable name the checkpoint lacks, a bad argument, a full disk) the
error also derives from that builtin, so ``except FileNotFoundError`` or
``except OSError`` keeps working::

    try:
        state = cp.load_pytree(path)
    except cp.errors.IntegrityError as e:      # damaged, or changed while being read
        ...
    except cp.errors.CheckpointableNotFoundError as e:  # no such name (a KeyError)
        ...
    except cp.errors.CheckpointError as e:     # anything else the library refuses
        ...
"""

from __future__ import annotations

import errno

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointExistsError",
    "CheckpointableNotFoundError",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "NotACheckpointError",
    "MetadataError",
    "MissingHandlerError",
    "NoHandlerForObjectError",
    "IntegrityError",
    "PluginError",
    "TreeMismatchError",
    "UnsupportedPathError",
    "OutsideCheckpointError",
    "DiskFullError",
    "NameTooLongError",
    "FileTooLargeError",
    "StorageError",
    "from_os_error",
    "CheckpointChangedError",
]


class CheckpointError(Exception):
    """Base class of every error checkpointables raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """Nothing exists at the path given (or a file a checkpoint needs is missing)."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A save would replace something that exists; pass ``overwrite=True`` to replace it."""


class CheckpointableNotFoundError(CheckpointError, KeyError):
    """A checkpoint holds no checkpointable of the name asked for (``checkpointable_name=``,
    a key of ``abstract_checkpointables``), or no pytree to load.

    A ``KeyError``; the message names the checkpointables the checkpoint holds
    and what to pass instead.
    """

    def __str__(self) -> str:
        return str(self.args[0])  # KeyError's own would show the message quoted.


class InvalidArgumentError(CheckpointError, ValueError):
    """An argument cannot work: a bad name, an empty dict, a path that cannot hold a checkpoint."""


class InvalidArgumentTypeError(CheckpointError, TypeError):
    """An argument has a type the function does not accept."""


class NotACheckpointError(CheckpointError, ValueError):
    """A directory exists but is not a finished checkpoint.

    Raised for empty directories, temporary directories left by an unfinished
    save, and directories missing ``_CHECKPOINT_METADATA``.
    """


class MetadataError(CheckpointError, ValueError):
    """A metadata file is unreadable or malformed; the message names the file."""


class MissingHandlerError(CheckpointError, LookupError):
    """No registered handler can load what a checkpoint recorded.

    The message names the recorded typestr and, when the typestr belongs to a
    known plugin, the distribution to ``pip install``.
    """


class NoHandlerForObjectError(CheckpointError, TypeError):
    """No registered handler accepts an object given for saving.

    The message names the checkpointable, its type and the handlers tried.
    """


class IntegrityError(CheckpointError):
    """Stored data or metadata failed its checksum, or is missing.

    The message names the leaf or the file. Metadata files are checked against
    the checksums recorded when the checkpoint was committed; a mismatch means
    the file was damaged, or replaced while it was being read (load again).
    """


class PluginError(CheckpointError, RuntimeError):
    """A plugin misbehaved while registering its handlers."""


class TreeMismatchError(CheckpointError, ValueError):
    """A tree does not match the tree it was expected to match.

    The message lists the key paths that are missing, extra or different.
    """


class UnsupportedPathError(CheckpointError, ValueError):
    """A path names a storage scheme (``memory://``, ``ftp://``...) that nothing here reaches."""


class OutsideCheckpointError(CheckpointError, ValueError):
    """A checkpoint points outside its own directory, and is refused.

    Raised for a recorded checkpointable name that is not a plain name
    (``../other``, an absolute path) and for a symbolic link inside the
    checkpoint whose target lies outside it. Nothing outside is read.
    """


class DiskFullError(CheckpointError, OSError):
    """A save ran out of disk space (or quota); ``errno`` is ``ENOSPC`` or ``EDQUOT``.

    Nothing was committed and the save's temporary directory was removed: free
    space (for example by keeping fewer checkpoints) and save again.
    """


class NameTooLongError(CheckpointError, OSError):
    """A path is too long for the filesystem; ``errno`` is ``ENAMETOOLONG``.

    Raised before anything is written when a checkpoint's or a checkpointable's
    name cannot be stored; choose a shorter name.
    """


class FileTooLargeError(CheckpointError, OSError):
    """A file of a save is larger than the filesystem or a limit allows; ``errno`` is
    ``EFBIG``.

    FAT32 and exFAT disks refuse files over 4 GiB, and a process's file size limit
    (``ulimit -f``) any larger file. Nothing was committed and the save's temporary
    directory was removed: save onto another filesystem, or raise the limit.
    """


class StorageError(CheckpointError, OSError):
    """Reading, writing, listing or deleting in storage failed (e.g. an object store refused
    or kept failing a request); the message names the path and what to check.

    Where storage gave no answer in time it is raised from a ``TimeoutError`` (its
    ``__cause__``): a failed save then leaves its files to the next cleanup rather than
    wait once more.
    """


class CheckpointChangedError(CheckpointError, RuntimeError):
    """A checkpoint was replaced or deleted while it was being read (e.g. by a save with
    ``overwrite=True`` in another process). Nothing is damaged: read it again."""


# What each of the operating system's errors means for a save: its class, and what to do.
_FROM_ERRNO: dict[int, tuple[type[OSError], str]] = {
    **dict.fromkeys(
        (errno.ENOSPC, errno.EDQUOT),
        (
            DiskFullError,
            "No space left on the device{where} while {what}. Nothing was committed and the "
            "save's temporary files were removed: free some space (for example by keeping "
            "fewer checkpoints) and save again",
        ),
    ),
    errno.EFBIG: (
        FileTooLargeError,
        "A file is larger than the filesystem or the process's file size limit allows{where} "
        "while {what} (FAT32 and exFAT hold at most 4 GiB a file; see ulimit -f). Nothing was "
        "committed and the save's temporary files were removed: save onto another "
        "filesystem, or raise the limit",
    ),
    errno.ENAMETOOLONG: (
        NameTooLongError,
        "A path is too long for the filesystem{where} while {what}. Choose a shorter "
        "checkpoint path or checkpointable name",
    ),
}


def from_os_error(error: OSError, what: str) -> OSError:
    """The library error for the operating system's ``error``, raised while doing ``what``
    (``error`` itself when none fits; it then keeps its builtin class).

    A full disk or quota becomes :class:`DiskFullError`, a file over a size limit
    :class:`FileTooLargeError`, a name too long :class:`NameTooLongError`; each keeps
    ``errno``. For plugins that write files::

        except OSError as e:
            raise cp.errors.from_os_error(e, f"writing {path}") from e
    """
    if isinstance(error, CheckpointError) or error.errno not in _FROM_ERRNO:
        return error
    cls, message = _FROM_ERRNO[error.errno]
    where = f" ({error.filename})" if error.filename else ""
    return cls(error.errno, message.format(where=where, what=what))
