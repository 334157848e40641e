/* Prometheus text format of a Metrics message; see metrics-text.h. */
#include <errno.h>
#include <math.h>

#include "metrics-text.h"

const char *moeep_metric_type_to_string(Moeep__V1__MetricType t) {
        switch (t) {
        case MOEEP__V1__METRIC_TYPE__METRIC_TYPE_COUNTER:
                return "counter";
        case MOEEP__V1__METRIC_TYPE__METRIC_TYPE_GAUGE:
                return "gauge";
        case MOEEP__V1__METRIC_TYPE__METRIC_TYPE_UNSPECIFIED:
        case _MOEEP__V1__METRIC_TYPE_IS_INT_SIZE:
                break;
        }
        return "untyped";
}

/* Escapes what the format escapes: backslash and newline everywhere, the
 * double quote too inside label values. */
static void write_escaped(FILE *f, const char *s, int quote) {
        for (; s && *s; s++)
                if (*s == '\\')
                        fputs("\\\\", f);
                else if (*s == '\n')
                        fputs("\\n", f);
                else if (*s == '"' && quote)
                        fputs("\\\"", f);
                else
                        fputc(*s, f);
}

static void write_value(FILE *f, double v) {
        if (isnan(v))
                fputs("NaN", f);
        else if (isinf(v))
                fputs(v > 0 ? "+Inf" : "-Inf", f);
        else if (v == floor(v) && fabs(v) < 9007199254740992.0) /* 2^53: exact as an integer */
                fprintf(f, "%.0f", v);
        else
                fprintf(f, "%.15g", v); /* 15 significant digits: no binary noise ("0.4") */
}

int moeep_metrics_write_text(const Moeep__V1__Metrics *m, FILE *f) {
        for (size_t i = 0; i < m->n_families; i++) {
                const Moeep__V1__MetricFamily *fam = m->families[i];

                fprintf(f, "# HELP %s ", fam->name);
                write_escaped(f, fam->help, 0);
                fprintf(f, "\n# TYPE %s %s\n", fam->name, moeep_metric_type_to_string(fam->type));
                for (size_t j = 0; j < fam->n_samples; j++) {
                        const Moeep__V1__MetricSample *s = fam->samples[j];

                        fputs(fam->name, f);
                        for (size_t k = 0; k < s->n_labels; k++) {
                                fprintf(f, "%s%s=\"", k ? "," : "{", s->labels[k]->name);
                                write_escaped(f, s->labels[k]->value, 1);
                                fputc('"', f);
                        }
                        fputs(s->n_labels ? "} " : " ", f);
                        write_value(f, s->value);
                        fputc('\n', f);
                }
        }
        return ferror(f) ? -EIO : 0;
}
