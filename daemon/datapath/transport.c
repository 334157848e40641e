/* Transports: the backend lookup; see transport.h. */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "datapath/transport.h"
#include "log.h"

const struct tp_ops *tp_ops_find(const char *name) {
        static const struct tp_ops *const all[] = { &tp_fabric_ops, &tp_verbs_ops, &tp_cuda_ops,
                                                    &tp_loop_ops };

        for (size_t i = 0; name && i < sizeof(all) / sizeof(all[0]); i++)
                if (strcmp(all[i]->name, name) == 0)
                        return all[i];
        return NULL;
}

int transport_open(const struct tp_config *cfg, struct transport *ret, char *errmsg) {
        const struct tp_ops *ops = tp_ops_find(cfg->backend);
        struct tp *tp;
        int r;

        if (!ops)
                return errmsg_set(errmsg, -ENOENT,
                                  "transport '%s': unknown (need fabric, verbs, cuda or loop)",
                                  cfg->backend ? cfg->backend : "(null)");
        r = ops->open(cfg, &tp, errmsg);
        if (r < 0)
                return r;
        ret->ops = ops;
        ret->tp = tp;
        return 0;
}

void transport_close(struct transport *t) {
        if (t->ops && t->tp)
                t->ops->close(t->tp);
        t->ops = NULL;
        t->tp = NULL;
}
