/* A stand-in for an RDMA NIC, for InfiniStore's server on a machine without one.
 *
 * InfiniStore registers its memory pool with an RDMA device at start, even when its clients
 * use TCP, and refuses to start without one. Its TCP path never uses the registration. This
 * library, LD_PRELOADed into that server only, answers the verbs that start-up calls: one
 * device with one active InfiniBand port, a protection domain, and memory registrations
 * that succeed. A registration populates the pages it covers, as pinning them for a NIC
 * would, so the pool is as warm as on a machine with a real device. Everything else (queue
 * pairs, completion queues) stays the real libibverbs', which fails without a device.
 *
 * Built by kvfabric bench (cc -shared -fPIC) when it runs InfiniStore; never linked into
 * kvfabric.
 */
#include <infiniband/verbs.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#undef ibv_query_port
#undef ibv_reg_mr

static struct ibv_device stand_in_device = {
    .node_type = IBV_NODE_CA,
    .transport_type = IBV_TRANSPORT_IB,
    .name = "stand_in0",
    .dev_name = "uverbs0",
};
static struct ibv_device *device_list[2] = {&stand_in_device, NULL};

struct ibv_device **ibv_get_device_list(int *num_devices) {
    if (num_devices != NULL) {
        *num_devices = 1;
    }
    return device_list;
}

void ibv_free_device_list(struct ibv_device **list) { (void)list; }

const char *ibv_get_device_name(struct ibv_device *device) { return device->name; }

struct ibv_context *ibv_open_device(struct ibv_device *device) {
    struct ibv_context *context = calloc(1, sizeof(*context));
    if (context != NULL) {
        context->device = device;
        context->num_comp_vectors = 1;
    }
    return context;
}

int ibv_close_device(struct ibv_context *context) {
    free(context);
    return 0;
}

int ibv_query_port(struct ibv_context *context, uint8_t port_num,
                   struct _compat_ibv_port_attr *attr) {
    (void)context;
    if (port_num != 1) {
        return -1;
    }
    /* verbs.h's inline ibv_query_port passes a whole struct ibv_port_attr under this name. */
    struct ibv_port_attr *port = (struct ibv_port_attr *)attr;
    port->state = IBV_PORT_ACTIVE;
    port->max_mtu = IBV_MTU_4096;
    port->active_mtu = IBV_MTU_4096;
    port->lid = 1;
    port->link_layer = IBV_LINK_LAYER_INFINIBAND;
    return 0;
}

int ibv_query_gid(struct ibv_context *context, uint8_t port_num, int index, union ibv_gid *gid) {
    (void)context;
    (void)port_num;
    (void)index;
    memset(gid, 0, sizeof(*gid));
    return 0;
}

struct ibv_pd *ibv_alloc_pd(struct ibv_context *context) {
    struct ibv_pd *pd = calloc(1, sizeof(*pd));
    if (pd != NULL) {
        pd->context = context;
    }
    return pd;
}

int ibv_dealloc_pd(struct ibv_pd *pd) {
    free(pd);
    return 0;
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t length, int access) {
    (void)access;
    struct ibv_mr *mr = calloc(1, sizeof(*mr));
    if (mr == NULL) {
        return NULL;
    }
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t start = (uintptr_t)addr & ~(uintptr_t)(page - 1);
    size_t span = (uintptr_t)addr + length - start;
    if (madvise((void *)start, span, MADV_POPULATE_WRITE) != 0) {
        /* Older kernels: fault each page in for writing, as pinning does. */
        for (uintptr_t p = start; p < start + span; p += (uintptr_t)page) {
            __atomic_fetch_add((volatile unsigned char *)p, 0, __ATOMIC_RELAXED);
        }
    }
    mr->context = pd->context;
    mr->pd = pd;
    mr->addr = addr;
    mr->length = length;
    mr->lkey = 1;
    mr->rkey = 1;
    return mr;
}

int ibv_dereg_mr(struct ibv_mr *mr) {
    free(mr);
    return 0;
}
