/* moeepctl output: typed rows printed as aligned tables or as JSON. */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "ctl.h"

/* Length of the valid UTF-8 sequence at s (1..4), or 0 when invalid. */
static size_t utf8_sequence_length(const unsigned char *s) {
        size_t n;
        uint32_t cp;

        if (s[0] < 0x80)
                return 1;
        if ((s[0] & 0xe0) == 0xc0) {
                n = 2;
                cp = s[0] & 0x1f;
        } else if ((s[0] & 0xf0) == 0xe0) {
                n = 3;
                cp = s[0] & 0x0f;
        } else if ((s[0] & 0xf8) == 0xf0) {
                n = 4;
                cp = s[0] & 0x07;
        } else
                return 0;
        for (size_t i = 1; i < n; i++) {
                if ((s[i] & 0xc0) != 0x80)
                        return 0;
                cp = (cp << 6) | (s[i] & 0x3f);
        }
        /* Overlong forms, surrogates and values past U+10FFFF. */
        if ((n == 2 && cp < 0x80) || (n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000) ||
            (cp >= 0xd800 && cp <= 0xdfff) || cp > 0x10ffff)
                return 0;
        return n;
}

void ctl_note(const char *fmt, ...) {
        va_list ap;

        va_start(ap, fmt);
        vfprintf(stdout, fmt, ap);
        va_end(ap);
        fputc('\n', stdout);
}

void ctl_json_string(FILE *f, const char *s) {
        const unsigned char *p = (const unsigned char *)(s ? s : "");

        fputc('"', f);
        while (*p) {
                size_t n = utf8_sequence_length(p);

                if (n == 0) {
                        fputs("\\ufffd", f);
                        p++;
                        continue;
                }
                if (n > 1) {
                        fwrite(p, 1, n, f);
                        p += n;
                        continue;
                }
                switch (*p) {
                case '"':
                        fputs("\\\"", f);
                        break;
                case '\\':
                        fputs("\\\\", f);
                        break;
                case '\n':
                        fputs("\\n", f);
                        break;
                case '\t':
                        fputs("\\t", f);
                        break;
                case '\r':
                        fputs("\\r", f);
                        break;
                default:
                        if (*p < 0x20 || *p == 0x7f)
                                fprintf(f, "\\u%04x", *p);
                        else
                                fputc(*p, f);
                }
                p++;
        }
        fputc('"', f);
}

/* Human form of a daemon-supplied string: control bytes and invalid UTF-8
 * become '?', so that a client name cannot move the operator's cursor. */
static void human_string(FILE *f, const char *s) {
        const unsigned char *p = (const unsigned char *)s;

        if (!s || !s[0]) {
                fputc('-', f);
                return;
        }
        while (*p) {
                size_t n = utf8_sequence_length(p);

                if (n == 0 || (n == 1 && (*p < 0x20 || *p == 0x7f))) {
                        fputc('?', f);
                        p++;
                } else {
                        fwrite(p, 1, n, f);
                        p += n;
                }
        }
}

/* Columns a cell takes on a terminal: one per character (cells hold valid
 * UTF-8 only; wide characters are rare enough in names to ignore). */
static size_t display_width(const char *s) {
        size_t w = 0;

        for (const unsigned char *p = (const unsigned char *)s; *p; p++)
                w += (*p & 0xc0) != 0x80;
        return w;
}

static void human_duration(FILE *f, uint64_t ms) {
        uint64_t s = ms / 1000, d = s / 86400, h = s / 3600 % 24, m = s / 60 % 60;

        if (s < 60)
                fprintf(f, "%" PRIu64 ".%01" PRIu64 "s", s, ms % 1000 / 100);
        else if (d > 0)
                fprintf(f, "%" PRIu64 "d %" PRIu64 "h %" PRIu64 "m", d, h, m);
        else if (h > 0)
                fprintf(f, "%" PRIu64 "h %" PRIu64 "m %" PRIu64 "s", h, m, s % 60);
        else
                fprintf(f, "%" PRIu64 "m %" PRIu64 "s", m, s % 60);
}

/* `u`, or "-" and null when it stands for none. */
static void optional_u64(FILE *human, FILE *json, uint64_t u, bool none) {
        if (none) {
                fputc('-', human);
                fputs("null", json);
        } else {
                fprintf(human, "%" PRIu64, u);
                fprintf(json, "%" PRIu64, u);
        }
}

static void format_value(const struct ctl_column *col, const struct ctl_value *v, FILE *human, FILE *json) {
        switch (col->type) {
        case CTL_STRING:
                human_string(human, v->s);
                ctl_json_string(json, v->s);
                return;
        case CTL_UINT:
                fprintf(human, "%" PRIu64, v->u);
                fprintf(json, "%" PRIu64, v->u);
                return;
        case CTL_ID:
                optional_u64(human, json, v->u, v->u == 0);
                return;
        case CTL_UID:
                optional_u64(human, json, v->u, v->u == UINT32_MAX);
                return;
        case CTL_RANK:
                if (v->i < 0) {
                        fputc('-', human);
                        fputs("null", json);
                } else {
                        fprintf(human, "%" PRId64, v->i);
                        fprintf(json, "%" PRId64, v->i);
                }
                return;
        case CTL_RANKS:
                if (v->n == 0)
                        fputc('-', human);
                fputc('[', json);
                for (size_t i = 0; i < v->n; i++) {
                        fprintf(human, "%s%" PRIu32, i ? "," : "", v->list[i]);
                        fprintf(json, "%s%" PRIu32, i ? ", " : "", v->list[i]);
                }
                fputc(']', json);
                return;
        case CTL_DURATION_MS:
                human_duration(human, v->u);
                fprintf(json, "%" PRIu64, v->u);
                return;
        case CTL_BOOL:
                fputs(v->u ? "yes" : "no", human);
                fputs(v->u ? "true" : "false", json);
                return;
        }
}

void ctl_table_init(struct ctl_table *t, const struct ctl_column *columns, size_t ncolumns) {
        *t = (struct ctl_table){ .columns = columns, .ncolumns = ncolumns };
}

int ctl_table_add(struct ctl_table *t, const struct ctl_value *row) {
        size_t n = (t->nrows + 1) * t->ncolumns, base = t->nrows * t->ncolumns;
        char **human, **json;

        human = realloc(t->human, n * sizeof(*human));
        if (!human)
                return -ENOMEM;
        t->human = human;
        json = realloc(t->json, n * sizeof(*json));
        if (!json)
                return -ENOMEM;
        t->json = json;

        for (size_t c = 0; c < t->ncolumns; c++) {
                size_t hlen, jlen;
                int hr, jr;
                FILE *hf = open_memstream(&human[base + c], &hlen);
                FILE *jf = hf ? open_memstream(&json[base + c], &jlen) : NULL;

                if (!jf) {
                        if (hf) {
                                fclose(hf);
                                free(human[base + c]);
                        }
                        /* Free the cells of this row made so far. */
                        for (size_t k = 0; k < c; k++) {
                                free(human[base + k]);
                                free(json[base + k]);
                        }
                        return -ENOMEM;
                }
                format_value(&t->columns[c], &row[c], hf, jf);
                /* Both streams are closed, whatever the first one says. */
                hr = fclose(hf);
                jr = fclose(jf);
                if (hr != 0 || jr != 0) {
                        for (size_t k = 0; k <= c; k++) {
                                free(human[base + k]);
                                free(json[base + k]);
                        }
                        return -ENOMEM;
                }
        }
        t->nrows++;
        return 0;
}

/* Widest cell of column c, header included. */
static size_t column_width(const struct ctl_table *t, size_t c) {
        size_t width = display_width(t->columns[c].header);

        for (size_t r = 0; r < t->nrows; r++) {
                size_t w = display_width(t->human[r * t->ncolumns + c]);

                if (w > width)
                        width = w;
        }
        return width;
}

void ctl_table_print_json(const struct ctl_table *t, FILE *f) {
        fputc('[', f);
        for (size_t r = 0; r < t->nrows; r++) {
                fputs(r ? ",\n  {" : "\n  {", f);
                for (size_t c = 0; c < t->ncolumns; c++) {
                        fputs(c ? ", " : "", f);
                        ctl_json_string(f, t->columns[c].key);
                        fprintf(f, ": %s", t->json[r * t->ncolumns + c]);
                }
                fputc('}', f);
        }
        fputs(t->nrows ? "\n]" : "]", f);
}

void ctl_table_print_list(const struct ctl_table *t, bool json, FILE *f) {
        if (json) {
                ctl_table_print_json(t, f);
                fputc('\n', f);
                return;
        }

        /* Row 0 is the header line. */
        for (size_t r = 0; r <= t->nrows; r++)
                for (size_t c = 0; c < t->ncolumns; c++) {
                        const char *cell =
                                r == 0 ? t->columns[c].header : t->human[(r - 1) * t->ncolumns + c];

                        if (c + 1 == t->ncolumns)
                                fprintf(f, "%s\n", cell);
                        else
                                fprintf(f, "%s%*s", cell, (int)(column_width(t, c) - display_width(cell) + 2),
                                        "");
                }
}

void ctl_table_print_object(const struct ctl_table *t, bool json, FILE *f) {
        size_t width = 0;

        if (t->nrows == 0)
                return;
        for (size_t c = 0; c < t->ncolumns; c++) {
                size_t w = strlen(t->columns[c].header);

                if (w > width)
                        width = w;
        }
        if (json)
                fputc('{', f);
        for (size_t c = 0; c < t->ncolumns; c++) {
                if (json) {
                        fputs(c ? ",\n  " : "\n  ", f);
                        ctl_json_string(f, t->columns[c].key);
                        fprintf(f, ": %s", t->json[c]);
                } else
                        fprintf(f, "%s:%*s %s\n", t->columns[c].header,
                                (int)(width - strlen(t->columns[c].header)), "", t->human[c]);
        }
        if (json)
                fputs("\n}\n", f);
}

void ctl_table_done(struct ctl_table *t) {
        for (size_t i = 0; i < t->nrows * t->ncolumns; i++) {
                free(t->human[i]);
                free(t->json[i]);
        }
        free(t->human);
        free(t->json);
        t->human = t->json = NULL;
        t->nrows = 0;
}

int ctl_table_finish(struct ctl_table *t, int r, bool json, bool object, Moeep__V1__Response *resp) {
        if (r < 0)
                fprintf(stderr, "moeepctl: out of memory formatting %zu rows of output\n", t->nrows + 1);
        else if (object)
                ctl_table_print_object(t, json, stdout);
        else
                ctl_table_print_list(t, json, stdout);
        ctl_table_done(t);
        moeep__v1__response__free_unpacked(resp, NULL);
        return r < 0 ? 1 : 0;
}
