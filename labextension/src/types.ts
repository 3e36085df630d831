/**
 * Types of the jupyter-cedana REST API (docs/rest-api.yaml) and of its events.
 */

/** A kernel's suspend state. */
export type KernelState =
  'running' | 'suspending' | 'suspended' | 'resuming' | 'failed';

/** Where a suspended kernel is kept. */
export type Tier = 'offload' | 'disk';

/** One GPU used by a kernel's processes. */
export interface IGpu {
  index: number;
  uuid: string;
  memory_bytes: number;
  /** Percent, 0-100, or null when unknown. */
  utilization: number | null;
}

/** Progress of a suspend or a resume. */
export interface IProgress {
  phase: string;
  fraction: number;
  bytes_done?: number | null;
  bytes_total?: number | null;
}

/** A suspend or resume waiting for a free slot. */
export interface IQueued {
  action: 'suspend' | 'resume';
  /** 1: next to start. */
  position: number;
  since: string | null;
}

/** Why automatic suspend waits after failed suspends. */
export interface IBackoff {
  failures: number;
  reason: string;
  /** The failure will not go away by itself (e.g. a socket to another process). */
  not_checkpointable: boolean;
  retry_at: string;
}

/** What a kernel's checkpoint holds on disk, split (an incremental image's chain). */
export interface ICheckpointDisk {
  /** The newest image: a delta, or a whole image. */
  image_bytes: number;
  /** The bases under it; 0 for a whole image. */
  base_bytes: number;
  /** Images in the chain: 1 for a whole image. */
  layers: number;
  /** The kernel runs; its image is kept only as the base of its next suspend. */
  kept_base: boolean;
}

/** A kernel as `GET /api/cedana/kernels` describes it. */
export interface IKernel {
  id: string;
  name: string;
  state: KernelState;
  tier: Tier | null;
  execution_state: string;
  last_activity: string | null;
  idle_seconds: number;
  suspend_at: string | null;
  suspended_at: string | null;
  keep_awake_until: string | null;
  checkpoint_bytes: number;
  /** Absent from servers that have no incremental images; null: no image on disk. */
  checkpoint_disk?: ICheckpointDisk | null;
  last_suspend_seconds: number | null;
  last_resume_seconds: number | null;
  gpus: IGpu[];
  suspendable: boolean;
  reason: string | null;
  progress: IProgress | null;
  /** Waiting for a free slot; absent from servers that have no limits. */
  queued?: IQueued | null;
  /** Automatic suspend backs off; absent from servers that have no backoff. */
  backoff?: IBackoff | null;
}

/** The checkpoint budget in `GET /api/cedana/status`. */
export interface IBudget {
  limit: number | null;
  used: number;
  /** Of `used`: bases kept by running kernels (absent from older servers). */
  base_bytes?: number;
  bases_dropped?: number;
  reserved: number;
  available: number | null;
  orphaned_images: number;
  orphaned_bytes: number;
  orphaned_kernel_ids: string[];
}

/** `GET /api/cedana/status`. */
export interface IStatus {
  available: boolean;
  reason: string | null;
  criu_version: string | null;
  root: boolean;
  checkpoint_root: string;
  bytes_used: number;
  bytes_free: number;
  budget?: IBudget;
  queued?: { suspend: number; resume: number };
  gpu: {
    available: boolean;
    reason: string | null;
    driver_version?: string | null;
    devices: Record<string, unknown>[];
    checkpoint: boolean;
  };
}

/** The error body of every failed request. */
export interface IErrorBody {
  code: string;
  message: string;
}

/** The schema id of the server's kernel-state events. */
export const EVENT_SCHEMA_ID =
  'https://jupyter-cedana.readthedocs.io/events/kernel-state';

/** What happened, as the event's `action` says. */
export type EventAction =
  | 'suspending'
  | 'suspended'
  | 'resuming'
  | 'resumed'
  | 'failed'
  | 'progress'
  | 'keep-awake'
  | 'queued'
  | 'dequeued';

/** The data of a kernel-state event. */
export interface IKernelStateEvent {
  kernel_id: string;
  action: EventAction;
  state?: KernelState | null;
  tier?: Tier | null;
  duration_seconds?: number | null;
  checkpoint_bytes?: number | null;
  gpu_memory_freed_bytes?: number | null;
  reason?: string | null;
  progress?: IProgress | null;
  /** ISO time after which what the kernel did is lost (a failed lazy restore). */
  lost_after?: string | null;
}
