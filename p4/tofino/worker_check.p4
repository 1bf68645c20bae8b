// Worker check: (job_id, worker_id) -> the only ingress port that worker may send from.
// Managed by controlplane/jobs.py (table LtaIngress.worker_check.worker_ports).
#ifndef LTA_WORKER_CHECK
#define LTA_WORKER_CHECK

#include "headers.p4"

control WorkerCheck(in lta_t lta, in PortId_t ingress_port, inout ingress_metadata_t meta) {
    action expect_port(PortId_t port) {
        meta.worker_known = true;
        meta.worker_port = port;
    }
    action unknown_worker() {
        meta.worker_known = false;
    }
    table worker_ports {
        key = {
            lta.job_id: exact @name("job_id");
            lta.worker_id: exact @name("worker_id");
        }
        actions = { expect_port; @defaultonly unknown_worker; }
        default_action = unknown_worker();
        size = 4096;  // LTA_MAX_JOBS * LTA_MAX_WORKERS
    }
    PortId_t port_xor;  // 0 when the packet came from the worker's port
    action compute_port_xor() { port_xor = meta.worker_port ^ ingress_port; }
    // Keyless: keeps the XOR a field for the gateway (the compiler would fold it into the condition).
    table port_check {
        actions = { compute_port_xor; }
        const default_action = compute_port_xor();
        size = 1;
    }
    // True when the packet claims a worker id the job has and arrived on that worker's port.
    apply {
        worker_ports.apply();
        port_check.apply();  // a gateway compares fields with constants
        if (meta.worker_known && port_xor != 0) {
            meta.worker_known = false;
        }
    }
}

#endif
