/* worker/dist/comm.h: placeholder of the communicator interface (replaced by the dist module). */
#ifndef MT_COMM_H
#define MT_COMM_H
#include <stddef.h>
#include "common/mt.h"
typedef struct mt_comm mt_comm;
typedef struct mt_comm_ops {
    mt_status (*all_reduce_sum)(mt_comm *c, float *buf, size_t count);
    mt_status (*all_gather)(mt_comm *c, const float *send, float *recv, size_t count);
    mt_status (*broadcast)(mt_comm *c, void *buf, size_t bytes, int root);
    mt_status (*barrier)(mt_comm *c);
    void (*destroy)(mt_comm *c);
} mt_comm_ops;
struct mt_comm {
    const mt_comm_ops *ops;
    int rank, size;
};
#endif
