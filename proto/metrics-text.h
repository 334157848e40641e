/* The Prometheus text exposition format (version 0.0.4) of a Metrics
 * message: what moeepd's HTTP listener serves and what `moeepctl metrics`
 * prints, written by this one function so that both always agree. */
#ifndef MOEEP_METRICS_TEXT_H
#define MOEEP_METRICS_TEXT_H

#include <stdio.h>

#include "moeep.pb-c.h"

/* The Content-Type that goes with it over HTTP. */
#define MOEEP_METRICS_CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"

/* "counter", "gauge", or "untyped" for anything else. */
const char *moeep_metric_type_to_string(Moeep__V1__MetricType t);

/* Writes every family as "# HELP", "# TYPE" and one line per sample.
 * Label values are escaped (backslash, double quote, newline) and help
 * text too (backslash, newline); whole numbers print without exponent.
 * Returns 0, or -EIO when writing to `f` failed. */
int moeep_metrics_write_text(const Moeep__V1__Metrics *m, FILE *f);

#endif
