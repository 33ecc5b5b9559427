// Creating and writing files without following links.
//
// Everything strata writes (checkpoints and their temporaries, `latest`, the metrics log, swap
// files, probe files) is created through these calls, so a symbolic link planted at one of its
// names is never followed: a link at a final name is replaced by rename(2) (which replaces the
// link itself), a link or a stale file at a temporary name is removed (unlink(2) removes the
// link, never its target) and the temporary is created afresh with O_CREAT | O_EXCL |
// O_NOFOLLOW, with an explicit mode (the umask still applies).
//
// Errors are a Status naming the path and the errno text (errno_status), so a caller only adds
// what it was doing. All calls are thread-compatible (no shared state).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "strata/status.h"

namespace strata {

// Whether a file about to be read whole may be: OK when `path` is a regular file or there is
// nothing there (the caller's open says so); kInvalidArgument naming `what` and `path` when it is
// a directory, a device, a pipe or a socket (a device such as /dev/zero never ends).
Status expect_regular_file(const std::string& path, const std::string& what);

// Creates `path` exclusively (O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, `mode`).
// When something already sits at `path` (a temporary left by a killed run, or a planted link),
// that directory entry is removed and the create tried once more; a second EEXIST (someone
// races us) is an error. Returns the open descriptor; the caller closes it.
Result<int> create_temp_file(const std::string& path, mode_t mode);

// Opens `path` for writing without following a link at it (O_NOFOLLOW; ELOOP becomes a message
// saying that `path` is a symbolic link). `append`: O_APPEND, else O_TRUNC. Creates it with
// `mode` when missing. Character devices (/dev/null, /dev/full) are allowed.
Result<int> open_for_writing(const std::string& path, bool append, mode_t mode);

// write(2) until all `n` bytes are written, retrying EINTR and short writes. `*offset` (the
// file offset `data` starts at, for the message) advances by what was written. ENOSPC says how
// many of the bytes were written.
Status write_fully(int fd, const void* data, size_t n, const std::string& path, uint64_t* offset);

// fsync(2) of directory `dir` (makes a rename or unlink in it durable).
Status fsync_directory(const std::string& dir);

// The directory part of `path` ("." when it has none).
std::string directory_of(const std::string& path);

// Writes `text` to `path` atomically: `path`.tmp (create_temp_file), fsync, rename over `path`,
// fsync of the directory. A failure removes the temporary.
Status write_file_atomically(const std::string& path, const std::string& text, mode_t mode);

// Replaces the files `replaced` of directory `dir` together, so that a reader (or a kill -9 at
// any moment) sees either the old set or the new one, never a mix: `fill(tmp)` writes the new
// files into a fresh sibling directory `.<name>.strata-new-<pid>`, which also gets a hard link to
// every other entry of `dir` (a subdirectory is moved into it just before the swap); then the
// two directories are exchanged in one renameat2(RENAME_EXCHANGE) (where the file system lacks
// it: `dir` is renamed aside and the new one into place, so a reader sees the old set, no
// directory, or the new set) and the old one is removed. A missing `dir` is created with its
// parents; a link at `dir` is followed to the directory it names. The leftovers of a killed
// writer (`.<name>.strata-new-<pid>` / `-old-<pid>` of a pid that is gone) are removed first.
// The directory's inode changes; its files written by `fill` must be complete and synced when
// it returns (write_file_atomically does that).
Status write_directory_atomically(const std::string& dir, const std::vector<std::string>& replaced,
                                  const std::function<Status(const std::string& tmp)>& fill);

}  // namespace strata
