/* moeepctl metrics: the daemon's counters and gauges, in the Prometheus
 * text format (what the HTTP listener serves) or as JSON. */
#include <math.h>
#include <stdio.h>

#include "ctl.h"
#include "metrics-text.h"

/* [{"name", "type", "help", "samples": [{"labels": {..}, "value": N}]}] */
static void print_json(const Moeep__V1__Metrics *m, FILE *f) {
        fputc('[', f);
        for (size_t i = 0; i < m->n_families; i++) {
                const Moeep__V1__MetricFamily *fam = m->families[i];

                fputs(i ? ",\n  {\"name\": " : "\n  {\"name\": ", f);
                ctl_json_string(f, fam->name);
                fprintf(f, ", \"type\": \"%s\", \"help\": ", moeep_metric_type_to_string(fam->type));
                ctl_json_string(f, fam->help);
                fputs(", \"samples\": [", f);
                for (size_t j = 0; j < fam->n_samples; j++) {
                        const Moeep__V1__MetricSample *smp = fam->samples[j];

                        fputs(j ? ", {\"labels\": {" : "{\"labels\": {", f);
                        for (size_t k = 0; k < smp->n_labels; k++) {
                                fputs(k ? ", " : "", f);
                                ctl_json_string(f, smp->labels[k]->name);
                                fputs(": ", f);
                                ctl_json_string(f, smp->labels[k]->value);
                        }
                        /* JSON has no NaN or infinities. */
                        if (isfinite(smp->value))
                                fprintf(f, "}, \"value\": %.15g}", smp->value);
                        else
                                fputs("}, \"value\": null}", f);
                }
                fputs("]}", f);
        }
        fputs(m->n_families ? "\n]\n" : "]\n", f);
}

int ctl_metrics(struct ctl *ctl) {
        Moeep__V1__MetricsGet get = MOEEP__V1__METRICS_GET__INIT;
        Moeep__V1__Request req = MOEEP__V1__REQUEST__INIT;
        Moeep__V1__Response *resp;
        int r = 0;

        if (!ctl_require_operator(ctl, "metrics"))
                return 1;
        req.body_case = MOEEP__V1__REQUEST__BODY_METRICS_GET;
        req.metrics_get = &get;
        if (ctl_query(ctl, &req, MOEEP__V1__RESPONSE__BODY_METRICS, &resp) < 0)
                return 1;
        if (ctl->json)
                print_json(resp->metrics, stdout);
        else
                r = moeep_metrics_write_text(resp->metrics, stdout);
        moeep__v1__response__free_unpacked(resp, NULL);
        return r < 0 ? 1 : 0;
}
