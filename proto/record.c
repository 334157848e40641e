/* Record framing shared by moeepd and libmoeep; see record.h. */
#include <errno.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "messages.h"
#include "record.h"

int moeep_record_type_known(uint16_t type) {
        return moeep_message_lookup(type) != NULL;
}

int moeep_record_fds_expected(uint16_t type) {
        const struct moeep_message *m = moeep_message_lookup(type);

        return m ? m->fds : 0;
}

int moeep_record_encode(uint8_t *buf, uint16_t type, uint64_t request_id, const ProtobufCMessage *msg,
                        size_t nfds) {
        size_t len = protobuf_c_message_get_packed_size(msg);
        struct moeep_record_header hdr = {
                .magic = MOEEP_RECORD_MAGIC,
                .major = MOEEP_PROTOCOL_MAJOR,
                .type = type,
                .nfds = (uint16_t)nfds,
                .length = (uint32_t)len,
                .request_id = request_id,
        };

        if (len > MOEEP_RECORD_MAX - sizeof(hdr) || nfds > MOEEP_RECORD_MAX_FDS)
                return -EMSGSIZE;
        memcpy(buf, &hdr, sizeof(hdr));
        protobuf_c_message_pack(msg, buf + sizeof(hdr));
        return (int)(sizeof(hdr) + len);
}

int moeep_record_send_raw(int sock, const uint8_t *buf, size_t len, const int *fds, size_t nfds) {
        union {
                char buf[CMSG_SPACE(sizeof(int) * MOEEP_RECORD_MAX_FDS)];
                struct cmsghdr align;
        } control;
        struct iovec iov = { .iov_base = (void *)buf, .iov_len = len };
        struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };
        ssize_t n;

        if (nfds > MOEEP_RECORD_MAX_FDS)
                return -EMSGSIZE;
        if (nfds > 0) {
                struct cmsghdr *c;

                memset(&control, 0, sizeof(control));
                mh.msg_control = control.buf;
                mh.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
                c = CMSG_FIRSTHDR(&mh);
                c->cmsg_level = SOL_SOCKET;
                c->cmsg_type = SCM_RIGHTS;
                c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
                memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
        }
        do
                n = sendmsg(sock, &mh, MSG_NOSIGNAL);
        while (n < 0 && errno == EINTR);
        if (n < 0)
                return errno == EWOULDBLOCK ? -EAGAIN : -errno;
        if ((size_t)n != len)
                return -EIO; /* SOCK_SEQPACKET sends whole records or nothing */
        return 0;
}

int moeep_record_send(int sock, uint16_t type, uint64_t request_id, const ProtobufCMessage *msg,
                      const int *fds, size_t nfds) {
        static _Thread_local uint8_t buf[MOEEP_RECORD_MAX];
        int len = moeep_record_encode(buf, type, request_id, msg, nfds);

        if (len < 0)
                return len;
        return moeep_record_send_raw(sock, buf, (size_t)len, fds, nfds);
}

static void close_fds(int *fds, size_t n) {
        for (size_t i = 0; i < n; i++)
                if (fds[i] >= 0) {
                        close(fds[i]);
                        fds[i] = -1;
                }
}

void moeep_record_release(struct moeep_record *rec) {
        if (!rec)
                return;
        close_fds(rec->fds, rec->nfds);
        rec->nfds = 0;
}

/* Collects every descriptor of every SCM_RIGHTS message in `mh` into rec.
 * Returns -EBADMSG when there are more than a record may carry or a control
 * message of another kind arrived; the descriptors stay in rec either way. */
static int collect_fds(struct msghdr *mh, struct moeep_record *rec) {
        int r = 0;

        for (struct cmsghdr *c = CMSG_FIRSTHDR(mh); c; c = CMSG_NXTHDR(mh, c)) {
                size_t n;
                int *data;

                if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) {
                        r = -EBADMSG;
                        continue;
                }
                n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
                data = (int *)CMSG_DATA(c);
                for (size_t i = 0; i < n; i++) {
                        int fd;

                        memcpy(&fd, data + i, sizeof(fd));
                        if (rec->nfds < MOEEP_RECORD_RECV_FDS)
                                rec->fds[rec->nfds++] = fd;
                        else /* the kernel never passes more: a bug */
                                close(fd);
                        if (rec->nfds > MOEEP_RECORD_MAX_FDS)
                                r = -EBADMSG;
                }
        }
        return r;
}

int moeep_record_recv(int sock, struct moeep_record *rec, const char **ret_why) {
        int r = moeep_record_recv_keep(sock, rec, ret_why);

        if (r < 0)
                moeep_record_release(rec);
        return r;
}

int moeep_record_recv_keep(int sock, struct moeep_record *rec, const char **ret_why) {
        union {
                char buf[CMSG_SPACE(sizeof(int) * MOEEP_RECORD_RECV_FDS)];
                struct cmsghdr align;
        } control;
        struct iovec iov = { .iov_base = rec->buf, .iov_len = sizeof(rec->buf) };
        struct msghdr mh = {
                .msg_iov = &iov,
                .msg_iovlen = 1,
                .msg_control = control.buf,
                .msg_controllen = sizeof(control.buf),
        };
        Moeep__V1__ErrorCode code = MOEEP__V1__ERROR_CODE__ERROR_BAD_RECORD;
        const char *why = NULL;
        int expected, r;
        ssize_t n;

        rec->nfds = 0;
        rec->payload = NULL;
        rec->error_code = MOEEP__V1__ERROR_CODE__ERROR_UNSPECIFIED;
        do
                n = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC);
        while (n < 0 && errno == EINTR);
        if (n < 0)
                return errno == EWOULDBLOCK ? -EAGAIN : -errno;
        /* Descriptors first: a record of zero bytes reads like the end of
         * the connection but may carry some, which must not be lost. */
        r = collect_fds(&mh, rec);
        if (n == 0) {
                if (ret_why)
                        *ret_why = rec->nfds ? "a record of zero bytes" : NULL;
                return -ECONNRESET;
        }
        if (r < 0 || (mh.msg_flags & MSG_CTRUNC)) {
                why = "too many file descriptors or a foreign control message";
                code = MOEEP__V1__ERROR_CODE__ERROR_BAD_FDS;
                goto fail;
        }
        if (mh.msg_flags & MSG_TRUNC) {
                why = "record longer than 64 KiB";
                goto fail;
        }
        if ((size_t)n < sizeof(rec->hdr)) {
                why = "record shorter than its header";
                goto fail;
        }
        memcpy(&rec->hdr, rec->buf, sizeof(rec->hdr));
        if (rec->hdr.magic != MOEEP_RECORD_MAGIC) {
                why = "bad magic";
                goto fail;
        }
        if (rec->hdr.major != MOEEP_PROTOCOL_MAJOR) {
                why = "protocol major version differs";
                if (ret_why)
                        *ret_why = why;
                rec->error_code = MOEEP__V1__ERROR_CODE__ERROR_VERSION_MISMATCH;
                return -EPROTONOSUPPORT;
        }
        if (rec->hdr.length != (size_t)n - sizeof(rec->hdr) || rec->hdr.reserved != 0) {
                why = "length field does not match the record";
                goto fail;
        }
        if (rec->hdr.nfds != rec->nfds) {
                why = "descriptor count differs from the header";
                code = MOEEP__V1__ERROR_CODE__ERROR_BAD_FDS;
                goto fail;
        }
        if (!moeep_record_type_known(rec->hdr.type)) {
                why = "unknown record type";
                code = MOEEP__V1__ERROR_CODE__ERROR_UNKNOWN_TYPE;
                goto fail;
        }
        expected = moeep_record_fds_expected(rec->hdr.type);
        if (expected == MOEEP_FDS_ONE_OR_NONE && rec->nfds > 1) {
                why = "record type needs exactly one descriptor but carries several";
                code = MOEEP__V1__ERROR_CODE__ERROR_BAD_FDS;
                goto fail;
        }
        if ((expected >= 0 && rec->nfds != (size_t)expected)) {
                why = expected == 0    ? "descriptors on a record type that may not carry them"
                      : rec->nfds == 0 ? "record type needs exactly one descriptor but carries none"
                                       : "record type needs exactly one descriptor but carries several";
                code = MOEEP__V1__ERROR_CODE__ERROR_BAD_FDS;
                goto fail;
        }
        rec->payload = rec->buf + sizeof(rec->hdr);
        return 0;

fail:
        if (ret_why)
                *ret_why = why;
        rec->error_code = code;
        return -EBADMSG;
}

/* ------------------------------------------------------------ wire scan */

/* Reads a varint at *p (at most 10 bytes, before `end`). */
static int scan_varint(const uint8_t **p, const uint8_t *end, uint64_t *ret) {
        uint64_t v = 0;

        for (unsigned shift = 0; shift < 64 && *p < end; shift += 7) {
                uint8_t b = *(*p)++;

                v |= (uint64_t)(b & 0x7f) << shift;
                if (!(b & 0x80)) {
                        *ret = v;
                        return 0;
                }
        }
        return -EBADMSG;
}

/* Fields of one message seen so far: non-repeated fields by their index in
 * the descriptor, oneofs by their case member's offset. */
struct scan_seen {
        uint64_t fields[4];
        unsigned oneofs[8];
        unsigned noneofs;
};

static int scan_fail(const char **ret_why, const char *why) {
        if (ret_why)
                *ret_why = why;
        return -EBADMSG;
}

/* Records that field `f` of `desc` appeared; -EBADMSG for a second time of
 * a field that is not repeated, or a second member of one oneof. */
static int scan_seen_add(struct scan_seen *seen, const ProtobufCMessageDescriptor *desc,
                         const ProtobufCFieldDescriptor *f, const char **ret_why) {
        size_t i = (size_t)(f - desc->fields);

        if (f->label == PROTOBUF_C_LABEL_REPEATED)
                return 0;
        if (i < 64 * sizeof(seen->fields) / sizeof(seen->fields[0])) {
                if (seen->fields[i / 64] & (UINT64_C(1) << (i % 64)))
                        return scan_fail(ret_why, "a field that is not repeated appears twice");
                seen->fields[i / 64] |= UINT64_C(1) << (i % 64);
        }
        if (f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) {
                for (unsigned k = 0; k < seen->noneofs; k++)
                        if (seen->oneofs[k] == f->quantifier_offset)
                                return scan_fail(ret_why, "two members of one oneof");
                if (seen->noneofs < sizeof(seen->oneofs) / sizeof(seen->oneofs[0]))
                        seen->oneofs[seen->noneofs++] = f->quantifier_offset;
        }
        return 0;
}

static int scan_message(const ProtobufCMessageDescriptor *desc, const uint8_t *p, const uint8_t *end,
                        unsigned depth, const char **ret_why) {
        struct scan_seen seen = { 0 };
        unsigned unknown = 0;

        if (depth > MOEEP_RECORD_DEPTH_MAX)
                return scan_fail(ret_why, "messages nested too deep");
        while (p < end) {
                const ProtobufCFieldDescriptor *f;
                const uint8_t *value;
                uint64_t tag, n;
                int r;

                if (scan_varint(&p, end, &tag) < 0 || tag >> 3 == 0 || tag >> 3 > 0x1fffffff)
                        return scan_fail(ret_why, "a malformed field tag");
                switch (tag & 7) {
                case 0:
                        if (scan_varint(&p, end, &n) < 0)
                                return scan_fail(ret_why, "a malformed varint");
                        n = 0;
                        break;
                case 1:
                case 5:
                        n = (tag & 7) == 1 ? 8 : 4;
                        break;
                case 2:
                        if (scan_varint(&p, end, &n) < 0)
                                return scan_fail(ret_why, "a malformed length");
                        break;
                default: /* groups (3, 4) and the wire types 6, 7 that do not exist */
                        return scan_fail(ret_why, "a group or an unknown wire type");
                }
                if (n > (uint64_t)(end - p))
                        return scan_fail(ret_why, "a field longer than the message");
                value = p;
                p += n;
                f = protobuf_c_message_descriptor_get_field(desc, (unsigned)(tag >> 3));
                if (!f) {
                        if (++unknown > MOEEP_RECORD_UNKNOWN_MAX)
                                return scan_fail(ret_why, "more fields the daemon does not know than "
                                                          "MOEEP_RECORD_UNKNOWN_MAX (64) in one message");
                        continue;
                }
                r = scan_seen_add(&seen, desc, f, ret_why);
                if (r < 0)
                        return r;
                if (f->type == PROTOBUF_C_TYPE_MESSAGE && (tag & 7) == 2) {
                        r = scan_message(f->descriptor, value, value + n, depth + 1, ret_why);
                        if (r < 0)
                                return r;
                }
        }
        return 0;
}

int moeep_record_scan(const ProtobufCMessageDescriptor *desc, const uint8_t *data, size_t len,
                      const char **ret_why) {
        return scan_message(desc, data, data + len, 1, ret_why);
}

/* ------------------------------------------------------------ decoding */

Moeep__V1__Request *moeep_record_decode_request(const struct moeep_record *rec) {
        Moeep__V1__Request *m;

        if (rec->hdr.type < MOEEP_TYPE_REQUEST_MIN || rec->hdr.type > MOEEP_TYPE_REQUEST_MAX ||
            moeep_record_scan(&moeep__v1__request__descriptor, rec->payload, rec->hdr.length, NULL) < 0)
                return NULL;
        m = moeep__v1__request__unpack(NULL, rec->hdr.length, rec->payload);
        if (m && (unsigned)m->body_case != rec->hdr.type) {
                moeep__v1__request__free_unpacked(m, NULL);
                return NULL;
        }
        return m;
}

Moeep__V1__Response *moeep_record_decode_response(const struct moeep_record *rec) {
        Moeep__V1__Response *m;

        if (rec->hdr.type < MOEEP_TYPE_RESPONSE_MIN || rec->hdr.type > MOEEP_TYPE_RESPONSE_MAX)
                return NULL;
        m = moeep__v1__response__unpack(NULL, rec->hdr.length, rec->payload);
        if (m && (unsigned)m->body_case != rec->hdr.type) {
                moeep__v1__response__free_unpacked(m, NULL);
                return NULL;
        }
        return m;
}

Moeep__V1__Event *moeep_record_decode_event(const struct moeep_record *rec) {
        Moeep__V1__Event *m;

        if (rec->hdr.type < MOEEP_TYPE_EVENT_MIN || rec->hdr.type > MOEEP_TYPE_EVENT_MAX)
                return NULL;
        m = moeep__v1__event__unpack(NULL, rec->hdr.length, rec->payload);
        if (m && (unsigned)m->body_case != rec->hdr.type) {
                moeep__v1__event__free_unpacked(m, NULL);
                return NULL;
        }
        return m;
}
