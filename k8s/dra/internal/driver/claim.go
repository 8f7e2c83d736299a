package driver

import (
	"fmt"
	"regexp"
	"sort"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"

	"devbroker.io/k8s/dra/internal/broker"
)

// CDIKind is the CDI kind of the broker's tenant devices (`devbroker cdi`).
const CDIKind = "devbroker.io/gpu"

// The broker's tenant names (src/devbroker/broker/policy.py): they name the
// tenant's directory on its FUSE mount.
var tenantName = regexp.MustCompile(`^[a-z_][a-z0-9_-]{0,63}$`)

// TenantName is the broker tenant of a claim. It is derived from the claim's UID
// alone, so unprepare (which gets only namespace, name and UID) and a restarted
// plugin find it without any state of their own, and a new claim never reuses an
// old claim's CDI device name (the runtime may cache specs).
func TenantName(uid types.UID) (string, error) {
	name := "k8s-" + strings.ToLower(string(uid))
	if !tenantName.MatchString(name) {
		return "", fmt.Errorf("claim UID %q gives no valid tenant name", uid)
	}
	return name, nil
}

// CDIDeviceID is the CDI device a container gets for a tenant.
func CDIDeviceID(tenant string) string { return CDIKind + "=" + tenant }

// Plan is what one claim's allocation (the devices of this driver in it) makes of
// a broker tenant, and the answer to the kubelet.
type Plan struct {
	Tenant string
	// Spec uses the keys of a policy file's [tenants.NAME] table.
	Spec    map[string]any
	Labels  map[string]string
	Devices []kubeletplugin.Device
}

// PlanFor turns an allocated claim into a tenant. pool is this node's pool
// (the node name); gpus the broker's GPUs by index.
//
// One tenant per claim: it gets every GPU the claim was given here, and on each
// the memory the claim consumes there (results on the same GPU add up). The
// broker has one memory_quota for all of a tenant's GPUs, so a claim with
// different amounts on different GPUs gets the smallest on each: never more
// than the scheduler set aside. Likewise its compute_weight.
func PlanFor(claim *resourceapi.ResourceClaim, pool string, gpus map[int]broker.GPU) (*Plan, error) {
	if claim.Status.Allocation == nil {
		return nil, fmt.Errorf("claim %s/%s is not allocated", claim.Namespace, claim.Name)
	}
	tenant, err := TenantName(claim.UID)
	if err != nil {
		return nil, err
	}
	memory := map[int]int64{}
	compute := map[int]int64{}
	var devices []kubeletplugin.Device
	for _, r := range claim.Status.Allocation.Devices.Results {
		if r.Driver != DriverName {
			continue
		}
		if r.Pool != pool {
			return nil, fmt.Errorf("device %s/%s is in pool %q, this node's is %q", r.Pool, r.Device, r.Pool, pool)
		}
		index, err := DeviceIndex(r.Device)
		if err != nil {
			return nil, err
		}
		gpu, ok := gpus[index]
		if !ok {
			return nil, fmt.Errorf("device %s: the broker has no GPU %d", r.Device, index)
		}
		// Without consumed capacity the device was allocated whole (a scheduler
		// that does not share devices): all of its memory and time.
		mem, cmp := gpu.Memory, int64(ComputeUnits)
		if q, ok := r.ConsumedCapacity[CapacityMemory]; ok {
			mem = q.Value()
		}
		if q, ok := r.ConsumedCapacity[CapacityCompute]; ok {
			cmp = q.Value()
		}
		if mem < 0 || cmp < 0 {
			return nil, fmt.Errorf("device %s: negative consumed capacity", r.Device)
		}
		memory[index] += mem
		compute[index] += cmp
		devices = append(devices, kubeletplugin.Device{
			Requests:     []string{r.Request},
			PoolName:     r.Pool,
			DeviceName:   r.Device,
			CDIDeviceIDs: []string{CDIDeviceID(tenant)},
			ShareID:      r.ShareID,
		})
	}
	if len(devices) == 0 {
		return nil, nil
	}
	indices := make([]int, 0, len(memory))
	for i := range memory {
		indices = append(indices, i)
	}
	sort.Ints(indices)
	quota, weight := memory[indices[0]], compute[indices[0]]
	for _, i := range indices[1:] {
		quota = min(quota, memory[i])
		weight = min(weight, compute[i])
	}
	weight = max(1, min(weight, ComputeUnits))
	var pods []string
	for _, ref := range claim.Status.ReservedFor {
		if ref.Resource == "pods" {
			pods = append(pods, ref.Name)
		}
	}
	sort.Strings(pods)
	return &Plan{
		Tenant: tenant,
		Spec: map[string]any{
			"gpus":           indices,
			"memory_quota":   quota,
			"compute_weight": weight,
		},
		Labels: map[string]string{
			"namespace": claim.Namespace,
			"claim":     claim.Name,
			"pod":       strings.Join(pods, ","),
		},
		Devices: devices,
	}, nil
}
