package driver

import (
	"reflect"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	"devbroker.io/k8s/dra/internal/broker"
)

const GiB = int64(1) << 30

var testGPUs = map[int]broker.GPU{
	0: {Index: 0, Name: "NVIDIA H200", UUID: "GPU-0", Memory: 32 * GiB},
	1: {Index: 1, Name: "NVIDIA H200", UUID: "GPU-1", Memory: 16 * GiB},
}

func result(request, pool, device string, consumed map[string]string) resourceapi.DeviceRequestAllocationResult {
	r := resourceapi.DeviceRequestAllocationResult{Request: request, Driver: DriverName, Pool: pool, Device: device}
	if consumed != nil {
		r.ConsumedCapacity = map[resourceapi.QualifiedName]resource.Quantity{}
		for k, v := range consumed {
			r.ConsumedCapacity[resourceapi.QualifiedName(k)] = resource.MustParse(v)
		}
	}
	return r
}

func claim(results ...resourceapi.DeviceRequestAllocationResult) *resourceapi.ResourceClaim {
	return &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: "team", Name: "pod-a-gpu",
			UID: types.UID("0F1E2D3C-aaaa-bbbb-cccc-000000000001")},
		Status: resourceapi.ResourceClaimStatus{
			Allocation: &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{Results: results}},
			ReservedFor: []resourceapi.ResourceClaimConsumerReference{
				{Resource: "pods", Name: "pod-b", UID: "u2"}, {Resource: "pods", Name: "pod-a", UID: "u1"}},
		},
	}
}

func TestTenantNameIsTheClaimUIDAndValidForTheBroker(t *testing.T) {
	name, err := TenantName("0F1E2D3C-aaaa-bbbb-cccc-000000000001")
	if err != nil || name != "k8s-0f1e2d3c-aaaa-bbbb-cccc-000000000001" {
		t.Fatalf("got %q, %v", name, err)
	}
	for _, bad := range []types.UID{"../x", "a b", types.UID(strings.Repeat("a", 61))} {
		if n, err := TenantName(bad); err == nil {
			t.Errorf("TenantName(%q) = %q, want an error", bad, n)
		}
	}
}

func TestPlanTakesTheConsumedMemoryAndCompute(t *testing.T) {
	c := claim(result("gpu", "node-a", "gpu-0", map[string]string{"memory": "8Gi", "compute": "16"}))
	c.Status.Allocation.Devices.Results[0].ShareID = ptr.To(types.UID("share-1"))
	plan, err := PlanFor(c, "node-a", testGPUs)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]any{"gpus": []int{0}, "memory_quota": 8 * GiB, "compute_weight": int64(16)}
	if !reflect.DeepEqual(plan.Spec, want) {
		t.Errorf("spec %v, want %v", plan.Spec, want)
	}
	if plan.Labels["namespace"] != "team" || plan.Labels["claim"] != "pod-a-gpu" || plan.Labels["pod"] != "pod-a,pod-b" {
		t.Errorf("labels %v", plan.Labels)
	}
	if len(plan.Devices) != 1 {
		t.Fatalf("devices %v", plan.Devices)
	}
	d := plan.Devices[0]
	if d.PoolName != "node-a" || d.DeviceName != "gpu-0" || !reflect.DeepEqual(d.Requests, []string{"gpu"}) ||
		!reflect.DeepEqual(d.CDIDeviceIDs, []string{"devbroker.io/gpu=" + plan.Tenant}) || *d.ShareID != "share-1" {
		t.Errorf("device %+v", d)
	}
}

func TestResultsOnOneGPUAddUpAndTheSmallestGPUShareIsTheQuota(t *testing.T) {
	c := claim(
		result("a", "node-a", "gpu-0", map[string]string{"memory": "4Gi", "compute": "8"}),
		result("b", "node-a", "gpu-0", map[string]string{"memory": "6Gi", "compute": "8"}),
		result("c", "node-a", "gpu-1", map[string]string{"memory": "8Gi", "compute": "4"}),
	)
	plan, err := PlanFor(c, "node-a", testGPUs)
	if err != nil {
		t.Fatal(err)
	}
	// gpu 0: 10 GiB, weight 16; gpu 1: 8 GiB, weight 4 -> one quota for both: 8 GiB, 4
	want := map[string]any{"gpus": []int{0, 1}, "memory_quota": 8 * GiB, "compute_weight": int64(4)}
	if !reflect.DeepEqual(plan.Spec, want) {
		t.Errorf("spec %v, want %v", plan.Spec, want)
	}
	if len(plan.Devices) != 3 {
		t.Errorf("devices %v", plan.Devices)
	}
}

func TestAWholeDeviceAllocationGetsTheWholeGPU(t *testing.T) {
	plan, err := PlanFor(claim(result("gpu", "node-a", "gpu-1", nil)), "node-a", testGPUs)
	if err != nil {
		t.Fatal(err)
	}
	if plan.Spec["memory_quota"] != 16*GiB || plan.Spec["compute_weight"] != int64(ComputeUnits) {
		t.Errorf("spec %v", plan.Spec)
	}
}

func TestOtherDriversResultsAreNotOurs(t *testing.T) {
	r := result("nic", "node-a", "eth0", nil)
	r.Driver = "net.example.com"
	plan, err := PlanFor(claim(r), "node-a", testGPUs)
	if err != nil || plan != nil {
		t.Errorf("plan %v, err %v: want neither", plan, err)
	}
}

func TestRefusedAllocations(t *testing.T) {
	unallocated := claim()
	unallocated.Status.Allocation = nil
	for name, tc := range map[string]struct {
		claim *resourceapi.ResourceClaim
		want  string
	}{
		"unallocated":    {unallocated, "not allocated"},
		"other node":     {claim(result("g", "node-b", "gpu-0", nil)), `this node's is "node-a"`},
		"unknown gpu":    {claim(result("g", "node-a", "gpu-7", nil)), "no GPU 7"},
		"foreign device": {claim(result("g", "node-a", "gpu-01", nil)), "not one of"},
		"negative":       {claim(result("g", "node-a", "gpu-0", map[string]string{"memory": "-1"})), "negative"},
	} {
		if _, err := PlanFor(tc.claim, "node-a", testGPUs); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err %v, want %q", name, err, tc.want)
		}
	}
}

func TestContainersUsingFollowsTemplateAndDirectClaims(t *testing.T) {
	pod := &corev1.Pod{
		Spec: corev1.PodSpec{
			ResourceClaims: []corev1.PodResourceClaim{
				{Name: "gpu", ResourceClaimTemplateName: ptr.To("tmpl")},
				{Name: "shared", ResourceClaimName: ptr.To("shared-claim")},
			},
			InitContainers: []corev1.Container{{Name: "init", Resources: corev1.ResourceRequirements{
				Claims: []corev1.ResourceClaim{{Name: "shared"}}}}},
			Containers: []corev1.Container{
				{Name: "main", Resources: corev1.ResourceRequirements{Claims: []corev1.ResourceClaim{{Name: "gpu"}}}},
				{Name: "side"},
			},
		},
		Status: corev1.PodStatus{ResourceClaimStatuses: []corev1.PodResourceClaimStatus{
			{Name: "gpu", ResourceClaimName: ptr.To("pod-a-gpu-x7k2")}}},
	}
	if got := ContainersUsing(pod, "pod-a-gpu-x7k2"); !reflect.DeepEqual(got, []string{"main"}) {
		t.Errorf("template claim: %v", got)
	}
	if got := ContainersUsing(pod, "shared-claim"); !reflect.DeepEqual(got, []string{"init"}) {
		t.Errorf("direct claim: %v", got)
	}
	if got := ContainersUsing(pod, "other"); got != nil {
		t.Errorf("other claim: %v", got)
	}
}
