/* libFuzzer target: the record layer (proto/record.c).
 *
 * Each input is one datagram sent on a SOCK_SEQPACKET socketpair with some
 * descriptors attached, then received with moeep_record_recv() and, when
 * accepted, decoded with every moeep_record_decode_*(). Input layout:
 *
 *   byte 0   descriptor count to attach (mod 67: past MOEEP_RECORD_MAX_FDS)
 *   byte 1   flags, see FLAG_* below
 *   rest     the datagram (with FLAG_FIX_HEADER, its header fields are
 *            made consistent so that the payload decoders are reached)
 *
 * Checked after every input: an accepted record agrees with its header (fd
 * count, known type, payload pointer), every fd it holds is open and
 * close-on-exec, at most one envelope decodes, a decoded message re-encodes
 * to its announced size, and once the record is released (or refused) no
 * descriptor is left open. */
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fuzz.h"
#include "record.h"

#define FLAG_FIX_HEADER 0x01   /* magic, length and reserved made right */
#define FLAG_FIX_NFDS 0x02     /* header nfds = descriptors attached */
#define FLAG_KEEP_MAJOR 0x04   /* leave the major as fuzzed (else 1) */
#define FLAG_PASSCRED 0x08     /* SO_PASSCRED on the receiver: SCM_CREDENTIALS, a foreign cmsg */
#define FLAG_OVERSIZE 0x10     /* pad the datagram past MOEEP_RECORD_MAX */
#define FLAG_REQUEST_TYPE 0x20 /* type forced into the request range */

/* Descriptors checked for leaks above the lowest free one. */
#define LEAK_WINDOW 96
/* Descriptors open at start-up (inherited ones, possibly with gaps below
 * them) are not ours to check, nor are the ones libFuzzer's own threads open
 * for a moment (its RSS watcher reads /proc): a leak is a descriptor of
 * /dev/null, the only file this target passes around. */
#define FD_TABLE 1024
static bool open_at_start[FD_TABLE];
static struct stat devnull_st;

static int sv[2] = { -1, -1 };
static int devnull = -1;
static struct moeep_record rec;
static uint8_t dgram[MOEEP_RECORD_MAX + 4096];
static uint8_t repack[MOEEP_RECORD_MAX * 2];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
        int sndbuf = 1 << 20;

        if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0)
                abort();
        setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf));
        setsockopt(sv[1], SOL_SOCKET, SO_RCVBUF, &sndbuf, sizeof(sndbuf));
        devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
        if (devnull < 0)
                abort();
        if (fstat(devnull, &devnull_st) < 0)
                abort();
        for (int fd = 0; fd < FD_TABLE; fd++)
                open_at_start[fd] = fcntl(fd, F_GETFD) >= 0;
        return 0;
}

static int lowest_free_fd(void) {
        int fd = dup(devnull);

        if (fd < 0)
                abort();
        close(fd);
        return fd;
}

static void check_no_fds_from(int first) {
        for (int fd = first; fd < first + LEAK_WINDOW && fd < FD_TABLE; fd++) {
                struct stat st;

                if (!open_at_start[fd] && fstat(fd, &st) == 0 && st.st_dev == devnull_st.st_dev &&
                    st.st_ino == devnull_st.st_ino) {
                        fprintf(stderr, "fuzz-record: descriptor %d leaked\n", fd);
                        abort();
                }
        }
}

/* Packs a decoded envelope again: protobuf-c must write exactly the size it
 * announced. */
static void check_repack(const ProtobufCMessage *m) {
        size_t want = protobuf_c_message_get_packed_size(m);

        if (want > sizeof(repack))
                return;
        if (protobuf_c_message_pack(m, repack) != want)
                abort();
}

/* Sends `len` bytes with `nfds` duplicates of /dev/null attached (ours are
 * closed again at once). Returns sendmsg's result. */
static ssize_t send_with_fds(const uint8_t *buf, size_t len, size_t nfds) {
        union {
                char buf[CMSG_SPACE(sizeof(int) * 80)];
                struct cmsghdr align;
        } control;
        struct iovec iov = { .iov_base = (void *)buf, .iov_len = len };
        struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };
        int fds[80];
        struct cmsghdr *c;
        ssize_t n;

        memset(&control, 0, sizeof(control));
        for (size_t i = 0; i < nfds; i++)
                fds[i] = dup(devnull);
        if (nfds > 0) {
                mh.msg_control = control.buf;
                mh.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
                c = CMSG_FIRSTHDR(&mh);
                c->cmsg_level = SOL_SOCKET;
                c->cmsg_type = SCM_RIGHTS;
                c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
                memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
        }
        n = sendmsg(sv[0], &mh, MSG_NOSIGNAL);
        for (size_t i = 0; i < nfds; i++)
                close(fds[i]);
        return n;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        struct moeep_record_header hdr;
        size_t nfds, len;
        uint8_t flags;
        int first, passcred, r;
        const char *why = NULL;

        if (size < 2)
                return 0;
        nfds = data[0] % 67;
        flags = data[1];
        len = size - 2;
        memcpy(dgram, data + 2, len);
        if ((flags & FLAG_FIX_HEADER) && len >= sizeof(hdr)) {
                memcpy(&hdr, dgram, sizeof(hdr));
                hdr.magic = MOEEP_RECORD_MAGIC;
                if (!(flags & FLAG_KEEP_MAJOR))
                        hdr.major = MOEEP_PROTOCOL_MAJOR;
                if (flags & FLAG_FIX_NFDS)
                        hdr.nfds = (uint16_t)nfds;
                if (flags & FLAG_REQUEST_TYPE)
                        hdr.type = (uint16_t)(MOEEP_TYPE_REQUEST_MIN + hdr.type % MOEEP_TYPE_REQUEST_MAX);
                hdr.reserved = 0;
                hdr.length = (uint32_t)(len - sizeof(hdr));
                memcpy(dgram, &hdr, sizeof(hdr));
        }
        if (flags & FLAG_OVERSIZE) {
                memset(dgram + len, 0, sizeof(dgram) - len);
                len = MOEEP_RECORD_MAX + 1 + len % 1024;
        }
        if (len == 0)
                return 0; /* a zero-length datagram reads as end of file */

        passcred = !!(flags & FLAG_PASSCRED);
        setsockopt(sv[1], SOL_SOCKET, SO_PASSCRED, &passcred, sizeof(passcred));
        first = lowest_free_fd();
        if (send_with_fds(dgram, len, nfds) < 0)
                abort(); /* the socketpair always takes one datagram */

        r = moeep_record_recv(sv[1], &rec, &why);
        if (r == 0) {
                Moeep__V1__Request *req = moeep_record_decode_request(&rec);
                Moeep__V1__Response *resp = moeep_record_decode_response(&rec);
                Moeep__V1__Event *ev = moeep_record_decode_event(&rec);

                if (rec.nfds != rec.hdr.nfds || !moeep_record_type_known(rec.hdr.type) ||
                    rec.payload != rec.buf + sizeof(rec.hdr) || rec.hdr.length + sizeof(rec.hdr) != len)
                        abort();
                for (size_t i = 0; i < rec.nfds; i++) {
                        int fl = fcntl(rec.fds[i], F_GETFD);

                        if (fl < 0 || !(fl & FD_CLOEXEC))
                                abort();
                }
                if (!!req + !!resp + !!ev > 1)
                        abort();
                if (req) {
                        check_repack(&req->base);
                        moeep__v1__request__free_unpacked(req, NULL);
                }
                if (resp) {
                        check_repack(&resp->base);
                        moeep__v1__response__free_unpacked(resp, NULL);
                }
                if (ev) {
                        check_repack(&ev->base);
                        moeep__v1__event__free_unpacked(ev, NULL);
                }
                moeep_record_release(&rec);
                moeep_record_release(&rec); /* a second release must be harmless */
        } else {
                if (r != -EBADMSG && r != -EPROTONOSUPPORT) {
                        fprintf(stderr, "fuzz-record: unexpected %d (%s)\n", r, strerror(-r));
                        abort();
                }
                if (!why)
                        abort(); /* every refusal says why */
        }
        check_no_fds_from(first);
        return 0;
}
